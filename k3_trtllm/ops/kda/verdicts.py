"""The KDA prefill kernels' snapshot verdicts on their way to the host (ops/kda/cuda.py queues them).

A prefill's snapshot points are device values, which the kernels check (a step with a bad entry
takes no snapshot at all). The verdict word comes back behind the launch, a 4-byte copy to pinned
memory with an event after it, and is read once the copy has landed: by the next KDA call on that
device (the ones that have landed), by ``TorchExecutor.execute`` after every step (the same), and
by it with waiting after a step that took snapshots, the step's sync point. A refused table raises
ValueError naming snapshot_offsets / snapshot_rows.

One ring per device: a device's events are waited for and its verdicts raised only by the checks
of that device, so two devices in one process (tests, rank threads) never read each other's.
Nothing here touches CUDA until a verdict is queued, so CPU callers may check freely (no ring:
nothing to read). Importing this module registers no kernel.
"""
from __future__ import annotations

import threading
from collections.abc import Callable

import torch

from ..capture import device_key

_BAD_SNAPSHOTS = ("snapshot_offsets / snapshot_rows break the contract (per sequence: points strictly "
                  "increasing in (0, its token count], each a multiple of 64 or that count, -1 entries last; "
                  "rows in [0, Ns))")


def refusal(what: str) -> str:
    """The message of a refused snapshot table (``what``: the call, e.g. its tokens and sequences)."""
    return f"k3::kda_prefill ({what}): {_BAD_SNAPSHOTS}; that call wrote no snapshot"


class Ring:
    """One device's verdict words of launched prefills: a ring of pinned words, each with the event
    recorded after its copy, read in launch order once the copy has landed. Preallocated, so a
    launch costs one 4-byte copy and one event record on the host. ``_words``, ``_event`` and
    ``_record`` are the only CUDA calls (the CPU tests replace them)."""

    SIZE = 64  # launches the host may run ahead of their verdicts before it waits for the oldest

    def __init__(self, device: torch.device):
        self.device = device
        self.lock = threading.Lock()  # the serve engine loop and a caller's thread may both run ops
        self.words: torch.Tensor | None = None
        self.events: list = []
        self.what: list[str] = [""] * self.SIZE
        self.head = self.count = 0  # oldest queued entry, entries queued
        self.table: tuple = ()  # the last queued call's tensors (kept alive: `is` stays exact) and key

    def _words(self) -> torch.Tensor:
        return torch.zeros(self.SIZE, dtype=torch.int32, pin_memory=True)

    def _event(self):
        return torch.cuda.Event()

    def _record(self, event) -> None:
        event.record(torch.cuda.current_stream(self.device))  # behind the word's copy on that stream

    def watch(self, word: Callable[[], torch.Tensor], table: tuple[torch.Tensor, ...], pool_rows: int,
              what: str) -> None:
        """Queue the verdict of a launched prefill (``word()``: its 4 bytes on this device, asked for
        only when queued: every KDA layer of a step repeats the table), unless the last queued call
        had the same table. A full ring waits for its oldest verdict first; when that one is a
        refusal it raises, with this call's verdict queued all the same (none is lost)."""
        key = (tuple((t.data_ptr(), tuple(t.shape)) for t in table), pool_rows)
        with self.lock:
            last = self.table
            if last and all(a is b for a, b in zip(last[0], table)) and last[1] == key:
                return
            if self.words is None:
                self.words = self._words()
                self.events = [self._event() for _ in range(self.SIZE)]
            refused = None
            if self.count == self.SIZE:  # the host is SIZE launches ahead: wait for the oldest
                _, refused = self._take_oldest(wait=True)
            i = (self.head + self.count) % self.SIZE
            self.words[i:i + 1].view(torch.uint8).copy_(word(), non_blocking=True)
            self._record(self.events[i])
            self.what[i] = what
            self.count += 1
            # only once queued: a later call with this table is skipped because its verdict is in the ring
            self.table = (table, key)
        if refused is not None:
            raise ValueError(refused)

    def _take_oldest(self, wait: bool) -> tuple[bool, str | None]:
        """(whether the oldest queued verdict was taken off the ring: ``wait``, waiting for its copy,
        else only if it has landed; its refusal message or None). The caller holds the lock."""
        i = self.head
        event = self.events[i]
        if not wait and not event.query():
            return False, None
        event.synchronize()
        bad = int(self.words[i]) != 0
        self.head, self.count = (i + 1) % self.SIZE, self.count - 1
        return True, refusal(self.what[i]) if bad else None

    def check(self, wait: bool) -> None:
        """Read the queued verdicts in order (``wait``: all, waiting for their copies; else those that
        have landed, stopping at the first that has not); raise for the first refused one (the
        verdicts after it stay queued for the next check)."""
        while True:
            with self.lock:
                if self.count == 0:
                    return
                taken, refused = self._take_oldest(wait)
            if not taken:
                return
            if refused is not None:
                raise ValueError(refused)


_rings: dict[torch.device, Ring] = {}
_rings_lock = threading.Lock()


def ring(device: torch.device) -> Ring:
    """The verdict ring of ``device`` (made on first use)."""
    key = device_key(device)
    found = _rings.get(key)
    if found is None:
        with _rings_lock:
            found = _rings.setdefault(key, Ring(key))
    return found


def check_snapshot_verdicts(wait: bool = True, device: torch.device | str | None = None) -> None:
    """Raise ValueError for a launched prefill whose snapshot points the kernels refused (that call
    wrote no snapshot). ``device``: that device's verdicts only (None: every device's); ``wait``:
    wait for every launched verdict, else read only those that have landed (no device sync)."""
    if device is None:
        for r in list(_rings.values()):
            r.check(wait)
        return
    found = _rings.get(device_key(torch.device(device)))
    if found is not None:  # no ring: no prefill of that device queued a verdict
        found.check(wait)
