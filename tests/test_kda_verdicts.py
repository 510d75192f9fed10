"""The KDA snapshot-verdict rings (k3_trtllm/ops/kda/verdicts.py) on the CPU: the real ``Ring`` with its
three CUDA calls (pinned words, events, event records) replaced by host stand-ins whose landing the
test decides, and the torch executor's per-step checks on the tiny model. The kernels' side (a bad
table refused on the device, the verdict through a real event) is in tests/gpu/test_kda_cuda.py."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from k3_trtllm.ops.kda import verdicts
from k3_trtllm.runtime import executor as executor_module
from k3_trtllm.runtime.engine import build_engine
from k3_trtllm.runtime.sequence import SamplingParams

TINY = Path(__file__).resolve().parents[1] / "examples" / "tiny-k3"
REFUSED = r"k3::kda_prefill \(call {}\): snapshot_offsets / snapshot_rows break the contract"


class HostEvent:
    """An event whose copy lands when the test says (or when waited for, as a CUDA event's does)."""

    def __init__(self):
        self.landed = True

    def query(self) -> bool:
        return self.landed

    def synchronize(self) -> None:
        self.landed = True


class HostRing(verdicts.Ring):
    def _words(self):
        return torch.zeros(self.SIZE, dtype=torch.int32)

    def _event(self):
        return HostEvent()

    def _record(self, event) -> None:
        event.landed = False  # recorded: its copy has not landed yet


def word(bad: bool):
    """A launch's verdict word, as the binding hands it over (asked for only when it is queued)."""
    return lambda: torch.tensor([int(bad)], dtype=torch.int32).view(torch.uint8)


def table() -> tuple[torch.Tensor, ...]:
    return torch.full((2, 1), -1, dtype=torch.int32), torch.zeros(2, 1, dtype=torch.int32), torch.tensor([0, 3, 5])


def test_a_full_ring_that_raises_keeps_the_new_verdict():
    """The host SIZE launches ahead waits for the oldest verdict; when that one is a refusal, the call
    raises it and its own verdict is queued all the same (a later call with its table is skipped:
    the verdict is in the ring, and the final check still raises it)."""
    ring = HostRing(torch.device("cpu"))
    ring.watch(word(True), table(), 6, "call 0")
    for i in range(1, ring.SIZE):
        ring.watch(word(False), table(), 6, f"call {i}")
    assert ring.count == ring.SIZE
    last = table()
    with pytest.raises(ValueError, match=REFUSED.format(0)):
        ring.watch(word(True), last, 6, f"call {ring.SIZE}")
    assert ring.count == ring.SIZE and ring.table[0] is last
    ring.watch(word(True), last, 6, "the same table again")  # skipped: no new entry
    assert ring.count == ring.SIZE
    with pytest.raises(ValueError, match=REFUSED.format(ring.SIZE)):
        ring.check(wait=True)
    assert ring.count == 0
    ring.check(wait=True)


def test_a_check_without_wait_reads_only_what_landed():
    ring = HostRing(torch.device("cpu"))
    ring.watch(word(False), table(), 6, "call 0")
    ring.watch(word(True), table(), 6, "call 1")
    ring.check(wait=False)  # nothing landed: nothing read, nothing waited for
    assert ring.count == 2
    ring.events[ring.head].landed = True
    ring.check(wait=False)  # the good one, then the refusal that has not landed stays queued
    assert ring.count == 1
    ring.events[ring.head].landed = True
    with pytest.raises(ValueError, match=REFUSED.format(1)):
        ring.check(wait=False)
    assert ring.count == 0


def test_each_device_reads_only_its_own_verdicts(monkeypatch):
    """Two devices' rings (here two device keys): a check of one never waits for nor raises the
    other's verdicts; a check of every device reads both."""
    monkeypatch.setattr(verdicts, "_rings", {})
    monkeypatch.setattr(verdicts, "Ring", HostRing)
    first, second = torch.device("cpu"), torch.device("meta")
    verdicts.ring(first).watch(word(False), table(), 6, "call 0")
    verdicts.ring(second).watch(word(True), table(), 6, "call 1")
    assert verdicts.ring(first) is verdicts.ring(torch.device("cpu"))
    verdicts.check_snapshot_verdicts(wait=True, device=first)
    assert verdicts.ring(second).count == 1 and not verdicts.ring(second).events[0].landed
    verdicts.check_snapshot_verdicts(wait=True, device="cuda:7")  # a device with no ring: nothing to read
    with pytest.raises(ValueError, match=REFUSED.format(1)):
        verdicts.check_snapshot_verdicts(wait=True)
    assert verdicts.ring(first).count == verdicts.ring(second).count == 0


def _engine():
    return build_engine(str(TINY), dtype=torch.float32, block_size=16, num_blocks=64, max_slots=4,
                        max_batch_size=4, max_num_tokens=256, max_seq_len=128, prefix_cache=True,
                        prefix_cache_interval=16, snapshot_slots=16)


PROMPTS = [list(range(3, 43)), list(range(5, 30))]
GREEDY = SamplingParams(max_new_tokens=3, temperature=0.0, ignore_eos=True)


def test_the_executor_checks_its_device_after_every_step(monkeypatch):
    """Every step reads its device's landed verdicts; a step that took snapshots waits for all."""
    calls = []
    monkeypatch.setattr(executor_module, "check_snapshot_verdicts",
                        lambda wait, device: calls.append((wait, device)))
    engine = _engine()
    executor, took = engine.runner.executor, []
    run = executor._run
    monkeypatch.setattr(executor, "_run", lambda step, decode: took.append(step.snapshot_offsets is not None)
                        or run(step, decode))
    engine.generate(PROMPTS, GREEDY)
    assert len(calls) == engine.stats.num_steps
    assert {device for _, device in calls} == {executor.device}
    assert [wait for wait, _ in calls] == took and True in took and False in took


def test_a_refused_table_reaches_the_user_as_its_error(monkeypatch):
    """A refusal in the executor's device ring surfaces from the step, named (not a hang, not later)."""
    monkeypatch.setattr(verdicts, "_rings", {})
    monkeypatch.setattr(verdicts, "Ring", HostRing)
    engine = _engine()
    verdicts.ring(engine.runner.executor.device).watch(word(True), table(), 6, "call 0")
    with pytest.raises(ValueError, match=REFUSED.format(0)):
        engine.generate(PROMPTS[:1], GREEDY)
