"""K3 at world size 2 on CPU (gloo): rank 0's engine broadcasts every step, the worker
rank runs its shard on it.

- Greedy tokens through the inflight runner at world 2 (tp2/ep1 from a converted
  checkpoint, tp2/ep2 MXFP4 from an HF checkpoint sharded at load), with chunked prefill
  and forced preemption, equal world 1 without either (fp64, so that the reordered sums
  of the row-parallel all-reduces cannot flip a greedy choice: see test_model_parallel).
- The HF checkpoint sharded at load is byte for byte the converter's rank files.
- The step packing round-trips every StepInputs field.
- Killing a worker, Ctrl-C on the process group and SIGTERM to rank 0 end `k3-trt run`
  within seconds, naming the rank where one failed, with no process left; so does a frozen
  worker (SIGSTOP: alive, silent) once a step's collectives time out; a rank that cannot
  load its shard is named, and no rank is left waiting for it.
- `k3-trt bench` at world 2 reports the step broadcast's cost at 256 running sequences.
"""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from datetime import timedelta
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from click.testing import CliRunner
from helpers import free_port, live_processes

from k3_trtllm.checkpoint.trtllm import load_trtllm_state_dict
from k3_trtllm.cli.bench import bench as bench_command
from k3_trtllm.convert import convert_checkpoint
from k3_trtllm.model import Parallel, build_step
from k3_trtllm.convert.in_memory import shard_hf_checkpoint
from k3_trtllm.model.step import is_pure_decode, pack_step, step_shapes, unpack_step
from k3_trtllm.runtime.distributed import HEADER_LEN, TIMEOUT_ENV, BroadcastExecutor, RankGroup, worker_loop
from k3_trtllm.runtime.engine import build_engine
from k3_trtllm.runtime.sequence import SamplingParams

# bench/world2.py's kill check finds the workers the way these tests do; the helper lives there
# (the package must not depend on bench or tests), and world2 imports its bench/ siblings
sys.path.append(str(Path(__file__).resolve().parents[1] / "bench"))
from world2 import spawned_children  # noqa: E402

K3_TRT = str(Path(sys.executable).with_name("k3-trt"))
PROMPTS = [torch.randint(3, 1024, (3 + 5 * (i % 8),), generator=torch.Generator().manual_seed(i)).tolist()
           for i in range(16)]
GREEDY = SamplingParams(max_new_tokens=6, ignore_eos=True)
# 16-token steps chunk every prompt longer than that; 6 blocks of 16 tokens hold two of
# the longer sequences, so decode steps run out and preempt (4 times).
TIGHT = dict(dtype=torch.float64, block_size=16, num_blocks=6, max_slots=8, max_batch_size=8, max_num_tokens=16,
             max_seq_len=64)
ROOMY = dict(TIGHT, num_blocks=64, max_num_tokens=2048)
END_WITHIN_S = 15


@pytest.fixture(scope="module")
def world1_tokens(ckpt_dir):
    out = {}
    for preset in ("tiny", "tiny-mxfp4"):
        engine = build_engine(ckpt_dir(preset), **ROOMY)
        results = engine.generate(PROMPTS, GREEDY)
        assert engine.summary()["preemptions"] == 0
        out[preset] = [r.output_token_ids for r in results]
    return out


@pytest.fixture(scope="module")
def tp2_checkpoint(ckpt_dir, tmp_path_factory):
    path = tmp_path_factory.mktemp("world") / "tiny-tp2"
    convert_checkpoint(ckpt_dir("tiny"), path, 2, 1, progress=False)
    return path


@pytest.mark.parametrize("preset, source, tp, ep", [("tiny", "converted", None, None), ("tiny-mxfp4", "hf", 2, 2)],
                         ids=["tp2-ep1-converted", "tp2-ep2-mxfp4-hf"])
def test_world2_greedy_tokens_equal_world1_with_chunking_and_preemption(preset, source, tp, ep, ckpt_dir,
                                                                        tp2_checkpoint, world1_tokens):
    model_dir = tp2_checkpoint if source == "converted" else ckpt_dir(preset)
    engine = build_engine(model_dir, tp=tp, ep=ep, **TIGHT)
    try:
        assert engine.runner.executor.world_size == 2
        results = engine.generate(PROMPTS, GREEDY)
        summary = engine.summary()
    finally:
        engine.close()
    assert not dist.is_initialized()  # the world this process started is gone with it
    assert [r.output_token_ids for r in results] == world1_tokens[preset]
    assert summary["preemptions"] > 0
    # recomputed after preemption: more than each prompt once and each generated token but the last
    assert summary["computed_tokens"] > sum(map(len, PROMPTS)) + len(PROMPTS) * (GREEDY.max_new_tokens - 1)
    assert max(map(len, PROMPTS)) > TIGHT["max_num_tokens"]  # prompts were prefilled in chunks


@pytest.mark.parametrize("preset, tp, ep", [("tiny", 2, 1), ("tiny-mxfp4", 2, 2)])
def test_hf_checkpoint_sharded_at_load_is_the_converters_rank_files(preset, tp, ep, ckpt_dir, tmp_path):
    convert_checkpoint(ckpt_dir(preset), tmp_path / "c", tp, ep, progress=False)
    for rank in range(tp):
        _, expected, _ = load_trtllm_state_dict(tmp_path / "c", rank)
        _, state, layout = shard_hf_checkpoint(ckpt_dir(preset), tp, ep, rank)
        parallel = Parallel.from_layout(layout, rank)
        assert (parallel.tp_rank, parallel.moe_ep_size, parallel.moe_ep_rank) == (rank, ep, rank % ep)
        assert state.keys() == expected.keys()
        for name, tensor in expected.items():
            assert state[name].dtype == tensor.dtype and state[name].shape == tensor.shape, name
            assert torch.equal(state[name].view(torch.uint8), tensor.view(torch.uint8)), name


@pytest.mark.parametrize("snapshots", [None, [[(3, 1)], [], [(1, 0), (2, 4)]]], ids=["no-snapshots", "snapshots"])
def test_packed_step_round_trips_every_field(snapshots):
    step = build_step([([5, 6, 7], 0, 2, [4]), ([9], 20, 0, [1, 3]), ([1, 2], 31, 5, [0, 2, 6])], 16,
                      snapshots=snapshots)
    step.logits_indices = step.logits_indices[1:]  # a prefill chunk that asks for no logits
    assert (step.snapshot_offsets is None) == (snapshots is None)
    shapes = step_shapes(step)
    back = unpack_step(shapes, pack_step(step).clone())
    for name, value in vars(step).items():
        got = getattr(back, name)
        assert got is None if value is None else torch.equal(got, value), name


def test_world2_checkpoint_at_other_tp_is_refused(tp2_checkpoint):
    with pytest.raises(ValueError, match=r"--tp 4 --ep 1: .* is converted for tp 2, ep 1"):
        build_engine(tp2_checkpoint, tp=4, num_blocks=4, max_slots=2)


def test_a_rank_that_cannot_load_its_shard_is_named(tp2_checkpoint, tmp_path):
    broken = tmp_path / "broken"
    shutil.copytree(tp2_checkpoint, broken)
    with open(broken / "rank1.safetensors", "r+b") as f:
        f.truncate(1000)
    with pytest.raises(ValueError, match=r"^rank 1: CheckpointError: .*rank1\.safetensors: truncated") as info:
        build_engine(broken, dtype=torch.float32, num_blocks=4, max_slots=2)
    assert "rank 0" not in str(info.value)
    assert not _no_process_left_children()
    assert not dist.is_initialized()


def _no_process_left_children() -> list[int]:
    deadline = time.monotonic() + 5
    while (left := spawned_children(os.getpid())) and time.monotonic() < deadline:
        time.sleep(0.1)
    return left


def _run_args(model_dir, max_new_tokens):
    return [K3_TRT, "run", str(model_dir), "--prompt-ids", "5,6,7", "--prompt-ids", "9,10", "--max-new-tokens",
            str(max_new_tokens), "--ignore-eos", "--device", "cpu", "--dtype", "float32", "--max-seq-len", "4096",
            "--num-blocks", "600", "--max-slots", "4", "--threads", "1"]


WATCHDOG_S = 120  # a run that never ends fails its test (the reads below would block) instead of hanging


def _kill_group_after(proc: subprocess.Popen, seconds: float) -> threading.Timer:
    def kill():
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass

    timer = threading.Timer(seconds, kill)
    timer.daemon = True
    timer.start()
    return timer


def _no_process_left(group: int) -> list[str]:
    deadline = time.monotonic() + 5  # multiprocessing's resource tracker leaves once its pipe closes
    while (left := live_processes(process_group=group)) and time.monotonic() < deadline:
        time.sleep(0.1)
    return left


def _interrupted_run(model_dir, interrupt, wait_s: float, env=None) -> tuple[int, int, float, str]:
    """Start a long ``run`` at world 2 in its own session, let both ranks step, call
    ``interrupt(proc)``, and return (process group, exit code, seconds to exit, stderr)."""
    proc = subprocess.Popen(_run_args(model_dir, 3000), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            start_new_session=True, text=True, env=env)
    watchdog = _kill_group_after(proc, WATCHDOG_S)
    try:
        for _ in range(4):  # tokens are streaming: both ranks are stepping
            assert proc.stdout.readline(), proc.stderr.read()
        start = time.monotonic()
        interrupt(proc)
        proc.stdout.read()
        code = proc.wait(wait_s)
        elapsed = time.monotonic() - start
        stderr = proc.stderr.read()
    finally:
        watchdog.cancel()
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    return proc.pid, code, elapsed, stderr


def _one_worker(proc) -> int:
    workers = spawned_children(proc.pid)
    assert len(workers) == 1
    return workers[0]


INTERRUPTS = {
    "kill-worker": lambda proc: os.kill(_one_worker(proc), signal.SIGKILL),
    "sigint-group": lambda proc: os.killpg(proc.pid, signal.SIGINT),  # what Ctrl-C in a terminal does
    "sigterm-rank0": lambda proc: os.kill(proc.pid, signal.SIGTERM),
}


@pytest.mark.parametrize("how", sorted(INTERRUPTS))
def test_a_fault_or_signal_ends_every_rank(how, tp2_checkpoint):
    group, code, elapsed, stderr = _interrupted_run(tp2_checkpoint, INTERRUPTS[how], END_WITHIN_S)
    assert elapsed < END_WITHIN_S
    assert code != 0
    assert not _no_process_left(group)
    if how == "kill-worker":
        assert code == 1
        lines = [line for line in stderr.splitlines() if line.startswith("Error:")]
        assert len(lines) == 1 and "Traceback" not in stderr, stderr
        assert "k3-trt world of 2 ranks failed in step" in lines[0]
        assert "rank 1 was killed by SIGKILL" in lines[0]


def test_a_frozen_worker_ends_the_run_within_the_collective_timeout(tp2_checkpoint):
    timeout_s = 3
    env = {**os.environ, "K3_TRT_DIST_TIMEOUT_S": str(timeout_s)}
    group, code, elapsed, stderr = _interrupted_run(  # SIGSTOP: alive, but answers nothing: a hang
        tp2_checkpoint, lambda proc: os.kill(_one_worker(proc), signal.SIGSTOP), END_WITHIN_S + timeout_s, env)
    assert code == 1 and elapsed < END_WITHIN_S + timeout_s
    assert "Traceback" not in stderr and "rank 1 stopped responding" in stderr, stderr
    assert not _no_process_left(group)


def test_bench_reports_the_step_broadcast_cost_at_256_sequences(tp2_checkpoint):
    args = [str(tp2_checkpoint), "--num-requests", "2", "--prompt-len", "4", "--output-len", "2", "--warmup", "0",
            "--device", "cpu", "--dtype", "float32", "--num-blocks", "8", "--max-slots", "2", "--max-seq-len", "64",
            "--quiet"]
    result = CliRunner().invoke(bench_command, args, catch_exceptions=False)
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    cost = report["step_broadcast"]
    # a decode step of 256 sequences with 64/16 = 4 blocks each: 9 int32 fields
    t = b = 256
    assert cost["payload_bytes"] == 4 * (3 * t + (b + 1) + 4 * b + b * 4)
    assert (cost["running_sequences"], cost["blocks_per_sequence"], cost["world_size"]) == (256, 4, 2)
    assert 0 < cost["ms_per_step"] < 1000


def _header_worker(rank: int, port: int, out: str) -> None:
    os.environ[TIMEOUT_ENV] = "2"
    store = dist.TCPStore("127.0.0.1", port, 2, rank == 0)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=2)
    control = dist.new_group(backend="gloo")
    if rank == 1:  # a worker frozen before it posted its receive: it never takes the header
        try:
            store.wait(["done"], timedelta(seconds=60))
        except Exception:
            pass  # rank 0, which hosts the store, has already left
        os._exit(0)
    start = time.monotonic()
    try:
        BroadcastExecutor._send_header(SimpleNamespace(group=SimpleNamespace(control=control)),
                                       torch.zeros(HEADER_LEN, dtype=torch.int32))
        result = "sent"
    except RuntimeError as e:
        result = str(e)
    Path(out).write_text(json.dumps({"result": result, "seconds": time.monotonic() - start}))
    store.set("done", "1")
    os._exit(0)  # the unreceived header stays pending: skip the group's teardown


def test_rank0_does_not_wait_forever_on_a_header_nobody_receives(tmp_path):
    """gloo sends once the receiver has posted: a worker frozen between steps must not hold rank 0
    in the header broadcast (whose group has no practical timeout) beyond the step timeout."""
    out = tmp_path / "out.json"
    mp.start_processes(_header_worker, args=(free_port(), str(out)), nprocs=2, start_method="spawn")
    got = json.loads(out.read_text())
    assert got["result"] == "the step header was not received within 2 s"
    assert 2 <= got["seconds"] < 5


class _PhaseRecorder:
    """An executor that records the phase each step reaches it with."""

    vocab_size, device = 8, torch.device("cpu")

    def __init__(self):
        self.phases = []

    def execute(self, step, decode):
        self.phases.append(decode)
        return torch.zeros(step.logits_indices.shape[0], self.vocab_size)


PHASE_STEPS = [[([5, 6], 0, 0, [0]), ([7], 0, 1, [1])],  # prompts: prefill
               [([8], 2, 0, [0]), ([9], 1, 1, [1])],  # a pure decode
               [([8], 0, 0, [0]), ([9], 1, 1, [1])]]  # one token each, one with no context: prefill


def _phase_worker(rank: int, port: int, out: str) -> None:
    store = dist.TCPStore("127.0.0.1", port, 2, rank == 0)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=2)
    group = RankGroup(rank, 2, torch.device("cpu"), dist.new_group(backend="gloo"), store, owned=False)
    recorder = _PhaseRecorder()
    if rank == 0:
        executor = BroadcastExecutor(recorder, group)
        for seqs in PHASE_STEPS:
            executor.execute(build_step(seqs, 4), is_pure_decode(seqs))
        executor.close()  # the stop header ends the worker's loop
    else:
        worker_loop(recorder, group)
    Path(out, f"rank{rank}.json").write_text(json.dumps(recorder.phases))
    dist.destroy_process_group()


def test_every_rank_runs_a_step_in_the_phase_rank0_decided(tmp_path):
    """The phase travels in the step header: a worker runs each step with rank 0's decision,
    never re-deriving it from the tensors."""
    mp.start_processes(_phase_worker, args=(free_port(), str(tmp_path)), nprocs=2, start_method="spawn")
    expected = [False, True, False]
    assert [is_pure_decode(seqs) for seqs in PHASE_STEPS] == expected
    for rank in range(2):
        assert json.loads((tmp_path / f"rank{rank}.json").read_text()) == expected, rank
