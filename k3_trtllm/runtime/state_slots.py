"""KDA state rows: one conv + recurrent state row per running sequence."""
from __future__ import annotations


class StateSlots:
    """A free list over the ``max_slots`` rows of the KDA conv/recurrent state pools."""

    def __init__(self, max_slots: int) -> None:
        if max_slots < 1:
            raise ValueError(f"max_slots must be >= 1, got {max_slots}")
        self.max_slots = max_slots
        self._free = list(range(max_slots - 1, -1, -1))
        self._used: set[int] = set()

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return len(self._used)

    def acquire(self) -> int:
        if not self._free:
            raise ValueError(f"all {self.max_slots} state slots are in use")
        slot = self._free.pop()
        self._used.add(slot)
        return slot

    def release(self, slot: int) -> None:
        if slot not in self._used:
            raise ValueError(f"state slot {slot} is not in use")
        self._used.remove(slot)
        self._free.append(slot)
