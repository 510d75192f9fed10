"""K3 across ranks (DESIGN §4-5) over torch.distributed: rank 0 owns the ``LLMEngine``
(scheduler, sampler, tokenizer) and every step broadcasts the step it scheduled; every
rank runs its shard of the model on it (the model's own all-reduces and the vocab gather
run inside). Workers never schedule: they receive, execute, and wait for the next step.

Process groups. Under ``torchrun`` (RANK / WORLD_SIZE / MASTER_ADDR in the environment) or
with a process group already initialised, k3-trt uses that group; otherwise rank 0 is the
calling process and it starts ranks 1..N-1 itself with ``torch.multiprocessing`` (spawn),
rendezvousing through a ``TCPStore`` it serves on 127.0.0.1. The default group (NCCL on
CUDA, gloo on CPU) carries the step payload and the model's collectives, with a short
``timeout`` so that a lost or stuck rank ends a step within seconds instead of hanging. The
step header goes over a second, gloo group with no practical timeout, because workers wait
on it for as long as a server stays idle.

Faults. Workers report errors and a heartbeat through the store; when a step fails, rank 0
names the rank that died, stopped or failed (``RankFailure``). Spawned workers ignore
SIGINT (rank 0 handles Ctrl-C and stops them) and die with rank 0 (``PR_SET_PDEATHSIG``),
and rank 0 watches their exits, so a dead worker ends the run even when rank 0 is idle.
"""
from __future__ import annotations

import atexit
import ctypes
import logging
import multiprocessing.connection
import os
import signal
import threading
import time
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from k3_trtllm.model.step import (PACKED_SHAPE_LEN, StepInputs, build_step, pack_step, packed_numel, step_shapes,
                                  unpack_step)

log = logging.getLogger(__name__)

DEFAULT_TIMEOUT_S = 30.0  # one step's collectives
STARTUP_TIMEOUT_S = 300.0  # spawned ranks importing torch; loading the model is not bounded
TIMEOUT_ENV = "K3_TRT_DIST_TIMEOUT_S"
IDLE_TIMEOUT = timedelta(days=365)  # the header group: a worker waits on it while the server is idle
HEARTBEAT_S = 0.5
STOP_GRACE_S = 10.0

# header[0] of a step broadcast: what the workers do with the payload that follows;
# header[1]: the step's phase (1: pure decode) as rank 0's runner decided it, so no rank re-derives it;
# header[2]: the prefix cache's KDA state-row copies rank 0 made since the last broadcast, whose
# (src, dst) pairs follow the packed step in the payload: a worker makes them before the step (a
# hit's restore costs no collective of its own)
OP_STOP, OP_RUN, OP_PROBE = 0, 1, 2
HEADER_LEN = 3 + PACKED_SHAPE_LEN
_KEY = "k3trt/"


class RankFailure(RuntimeError):
    """A rank died, stopped responding or failed; the message names it."""


def dist_timeout_s() -> float:
    text = os.environ.get(TIMEOUT_ENV)
    if text is None:
        return DEFAULT_TIMEOUT_S
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not value > 0:
        raise ValueError(f"{TIMEOUT_ENV}={text!r}: expected a positive number of seconds")
    return value


def launched_by_torchrun() -> bool:
    return all(k in os.environ for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"))


def check_world_one(model_dir) -> None:
    """A world-size-1 model under a torchrun of several ranks would run once per rank."""
    if launched_by_torchrun() and int(os.environ["WORLD_SIZE"]) > 1:
        raise ValueError(f"{model_dir} runs at world size 1, and torchrun started {os.environ['WORLD_SIZE']} ranks: "
                         "convert it with --tp N, pass --tp N, or run it without torchrun")


@dataclass(frozen=True)
class RankSpec:
    """Everything a rank needs to build its executor; the same on every rank."""

    model_dir: str
    dtype: torch.dtype
    device_type: str  # "cpu" or "cuda": each rank picks its own device index
    tp: int
    ep: int
    num_blocks: int
    max_slots: int
    block_size: int
    threads: int  # torch intra-op threads per rank on CPU (the host's cores shared by its ranks)
    batch_invariant: bool = False  # kernels.batch_invariant on CUDA (README: Reproducibility)
    snapshot_slots: int = 0  # prefix-cache KDA state snapshot rows (runtime/block_manager.py: PrefixCache)
    kv_cache_dtype: str = "auto"  # latent rows: auto, bf16 or fp8 (model/caches.py)


@dataclass
class RankGroup:
    """This process's place in the world and the groups the step broadcast uses."""

    rank: int
    world_size: int
    device: torch.device
    control: object  # gloo group for step headers
    store: object
    owned: bool  # k3-trt initialised the default group (and destroys it at the end)
    workers: list | None = None  # spawned worker processes (rank 0 of a self-started world only)

    @property
    def payload_device(self) -> torch.device:
        return self.device if dist.get_backend() == "nccl" else torch.device("cpu")


def rank_threads(tp: int) -> int:
    """torch intra-op CPU threads for each rank: this process's pool shared by the ranks that
    run on this host (torchrun's LOCAL_WORLD_SIZE, else all ``tp`` ranks are started here)."""
    return max(1, torch.get_num_threads() // int(os.environ.get("LOCAL_WORLD_SIZE", tp)))


# -- starting the world ------------------------------------------------------------

def start_world(spec: RankSpec, world_size: int, make_executor) -> "BroadcastExecutor | None":
    """Join or start the world of ``world_size`` ranks and build this rank's executor with
    ``make_executor(spec, device)`` (a module-level function: spawned ranks get it pickled).
    Rank 0 gets the ``BroadcastExecutor``; a worker rank serves steps until rank 0 stops
    it and gets None."""
    timeout = dist_timeout_s()
    if dist.is_initialized() or launched_by_torchrun():
        group = _join_given_world(spec, world_size, timeout)
    else:
        group = _spawn_world(spec, world_size, timeout, make_executor)
    executor = _build_on_every_rank(spec, group, make_executor)
    if group.rank != 0:
        try:
            worker_loop(executor, group)
        except Exception as e:
            raise RankFailure(f"rank {group.rank}: lost the step broadcast from rank 0, which holds the engine "
                              f"({_one_line(e)})") from None
        if group.owned:
            dist.destroy_process_group()
        return None
    return BroadcastExecutor(executor, group)


def _build_on_every_rank(spec: RankSpec, group: RankGroup, make_executor):
    """Every rank builds its executor; any rank's error is raised on every rank, so that no
    rank waits for one that cannot serve."""
    _share_threads(spec, group.device)
    try:
        executor, error = make_executor(spec, group.device), ""
    except Exception as e:
        executor, error = None, f"{type(e).__name__}: {_one_line(e)}"
    errors = [None] * group.world_size
    try:
        dist.all_gather_object(errors, error, group=group.control)
    except Exception as e:
        failure = _failure(group, "while the ranks loaded the model", _one_line(e))
        _abandon(group)
        raise failure from None
    failed = [(r, m) for r, m in enumerate(errors) if m]
    if failed:
        _abandon(group)
        raise ValueError("; ".join(f"rank {r}: {m}" for r, m in failed))
    return executor


def _abandon(group: RankGroup) -> None:
    """End a world that cannot serve: its spawned workers, and the default group when k3-trt
    made it (so that this process can start another world later, e.g. a server retrying)."""
    if group.workers:
        _end_workers(group.workers)
    if group.owned and dist.is_initialized():
        dist.destroy_process_group()


def _join_given_world(spec: RankSpec, world_size: int, timeout: float) -> RankGroup:
    owned = not dist.is_initialized()
    if owned:
        env_world = int(os.environ["WORLD_SIZE"])
        if env_world != world_size:
            raise ValueError(f"{spec.model_dir} runs at world size {world_size}; torchrun started {env_world} "
                             f"ranks (WORLD_SIZE={env_world})")
        device = _rank_device(spec.device_type, int(os.environ.get("LOCAL_RANK", 0)))
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo", timeout=timedelta(seconds=timeout),
                                device_id=device if device.type == "cuda" else None)
    elif dist.get_world_size() != world_size:
        raise ValueError(f"{spec.model_dir} runs at world size {world_size}; the process group has "
                         f"{dist.get_world_size()} ranks")
    else:
        device = _rank_device(spec.device_type, int(os.environ.get("LOCAL_RANK", dist.get_rank())))
    store = dist.distributed_c10d._get_default_store()
    return RankGroup(dist.get_rank(), world_size, device, dist.new_group(backend="gloo", timeout=IDLE_TIMEOUT),
                     store, owned)


def _spawn_world(spec: RankSpec, world_size: int, timeout: float, make_executor) -> RankGroup:
    store = dist.TCPStore("127.0.0.1", 0, world_size, True, timedelta(seconds=max(timeout, STARTUP_TIMEOUT_S)),
                          wait_for_workers=False)
    context = mp.start_processes(_spawned_worker,
                                 args=(os.getpid(), store.port, world_size, spec, timeout, make_executor),
                                 nprocs=world_size - 1, join=False, start_method="spawn")
    workers = context.processes
    try:
        _wait_for_workers(store, workers)
        device = _rank_device(spec.device_type, 0)
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo", store=store, rank=0,
                                world_size=world_size, timeout=timedelta(seconds=timeout),
                                device_id=device if device.type == "cuda" else None)
        control = dist.new_group(backend="gloo", timeout=IDLE_TIMEOUT)
    except BaseException as e:
        dead = _dead_workers(workers)
        _end_workers(workers)
        if isinstance(e, Exception):
            raise RankFailure(f"the {world_size} ranks did not start: {dead or e}") from None
        raise
    return RankGroup(0, world_size, device, control, store, True, workers)


def _wait_for_workers(store, workers) -> None:
    """Until every spawned rank is up (importing torch takes seconds on a busy host): the
    process group's short timeout then bounds only the rendezvous itself."""
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    while store.add(f"{_KEY}up", 0) < len(workers):
        dead = _dead_workers(workers)
        if dead:
            raise RuntimeError(dead)
        if time.monotonic() > deadline:
            raise RuntimeError(f"not all ranks started within {STARTUP_TIMEOUT_S:.0f} s")
        time.sleep(0.05)


def _spawned_worker(index: int, parent: int, port: int, world_size: int, spec: RankSpec, timeout: float,
                    make_executor) -> None:
    rank = index + 1
    _die_with_parent(parent)
    # Ctrl-C reaches the whole terminal process group: rank 0 handles it and stops the workers.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    store = dist.TCPStore("127.0.0.1", port, world_size, False, timedelta(seconds=max(timeout, STARTUP_TIMEOUT_S)))
    store.add(f"{_KEY}up", 1)
    try:
        device = _rank_device(spec.device_type, rank)
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo", store=store, rank=rank,
                                world_size=world_size, timeout=timedelta(seconds=timeout),
                                device_id=device if device.type == "cuda" else None)
        group = RankGroup(rank, world_size, device, dist.new_group(backend="gloo", timeout=IDLE_TIMEOUT), store,
                          True)
        worker_loop(_build_on_every_rank(spec, group, make_executor), group)
        dist.destroy_process_group()
    except Exception as e:  # rank 0 reports it, naming this rank; no traceback from here
        _report_error(store, rank, e)
        os._exit(1)


def _rank_device(device_type: str, local_rank: int) -> torch.device:
    if device_type == "cuda":
        if local_rank >= torch.cuda.device_count():
            raise ValueError(f"local rank {local_rank} has no GPU: this host has {torch.cuda.device_count()}")
        torch.cuda.set_device(local_rank)
        return torch.device("cuda", local_rank)
    return torch.device(device_type)


def _share_threads(spec: RankSpec, device: torch.device) -> None:
    if device.type == "cpu":
        torch.set_num_threads(spec.threads)


def _die_with_parent(parent: int) -> None:
    """A spawned worker dies with rank 0 whatever kills it (Linux). The kernel sends it when
    the *thread* that started the worker ends, so build a multi-rank engine on a thread that
    outlives it (the main thread, as `run`, `bench` and the Triton model do)."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        return
    if os.getppid() != parent:  # rank 0 died before prctl took effect
        os._exit(1)


# -- rank 0 ------------------------------------------------------------------------

class BroadcastExecutor:
    """Rank 0's Executor: broadcasts each step, then runs its own shard; the logits are
    those of the whole vocabulary (the model gathers the vocab-parallel head)."""

    def __init__(self, local, group: RankGroup) -> None:
        self.local = local
        self.group = group
        self.vocab_size = local.vocab_size
        self.device = local.device
        # every rank runs the same executor kind; the step's snapshot points travel with it
        self.writes_snapshots = getattr(local, "writes_snapshots", False)
        self.world_size = group.world_size
        self._copies: list[int] = []  # flat (src, dst) pairs the workers have not made yet
        self.steps = 0
        self._failure: str | None = None
        self._clean = True  # no broadcast half-done: the workers wait for a header
        self._closed = False
        self._lock = threading.Lock()
        if group.workers:
            threading.Thread(target=self._watch_workers, name="k3-rank-monitor", daemon=True).start()
        atexit.register(self.close)

    def execute(self, step: StepInputs, decode: bool) -> torch.Tensor:
        self._broadcast(OP_RUN, step, decode)
        try:
            logits = self.local.execute(step, decode)
        except Exception as e:
            self._fail(e)
        self._clean = True
        return logits

    def copy_states(self, copies: list[tuple[int, int]]) -> None:
        """Every rank copies the state rows of its own KDA heads (rank 0 decided the copies):
        this one now, the others with the next step's broadcast, before they run it. No rank
        reads a state row between steps, so each makes the copies in the same order, between
        the same steps."""
        if self._failure is not None or self._closed:
            raise RankFailure(self._failure or "the ranks were stopped")
        self.local.copy_states(copies)
        self._copies += [r for pair in copies for r in pair]

    def probe_broadcast(self, step: StepInputs) -> None:
        """Broadcast ``step`` without running it; returns once every rank has it."""
        self._broadcast(OP_PROBE, step, False)
        try:
            dist.barrier(group=self.group.control)
        except Exception as e:
            self._fail(e)
        self._clean = True

    def _broadcast(self, op: int, step: StepInputs, decode: bool) -> None:
        if self._failure is not None or self._closed:
            raise RankFailure(self._failure or "the ranks were stopped")
        self._clean = False
        self.steps += 1
        shapes = step_shapes(step)
        header = torch.tensor([op, int(decode), len(self._copies) // 2, *shapes], dtype=torch.int32)
        payload = pack_step(step)
        if self._copies:
            payload = torch.cat([payload, torch.tensor(self._copies, dtype=torch.int32)])
            self._copies = []
        try:
            self._send_header(header)
            dist.broadcast(payload.to(self.group.payload_device), 0)
        except Exception as e:
            self._fail(e)

    def _send_header(self, header: torch.Tensor) -> None:
        """Broadcast a step header, bounded by the step timeout. gloo sends once the receiver
        has posted its receive, and the header group has no practical timeout (idle workers
        wait on it): a worker frozen before it posted would otherwise hold rank 0 forever."""
        work = dist.broadcast(header, 0, group=self.group.control, async_op=True)
        deadline = time.monotonic() + dist_timeout_s()
        pause = 0.0
        while not work.is_completed():
            if time.monotonic() > deadline:
                raise RuntimeError(f"the step header was not received within {dist_timeout_s():g} s")
            time.sleep(pause)
            pause = min(0.001, pause + 0.0001)  # usually posted already: the first checks are free
        work.wait()  # raises what the broadcast hit, if anything

    def _fail(self, error: Exception):
        self._failure = str(_failure(self.group, f"in step {self.steps}",
                                     f"{type(error).__name__}: {_one_line(error)}"))
        self.close()
        raise RankFailure(self._failure) from None

    def _watch_workers(self) -> None:
        workers = self.group.workers
        multiprocessing.connection.wait([p.sentinel for p in workers])
        if self._closed:
            return
        time.sleep(HEARTBEAT_S)  # let a failing step report first: it names the same rank
        if self._failure is None and not self._closed:
            self._failure = str(_failure(self.group, "while idle"))
            log.error("%s", self._failure)
            _end_workers(workers)

    def close(self) -> None:
        """Stop the workers: a stop header when they are waiting for one, else (or when
        they do not exit in time) SIGKILL. Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        atexit.unregister(self.close)
        if self._clean and self._failure is None:
            try:
                self._send_header(torch.tensor([OP_STOP] + [0] * (HEADER_LEN - 1), dtype=torch.int32))
            except Exception:
                self._clean = False  # a worker is gone or frozen: the ones left are ended below
        if self.group.workers:
            deadline = time.monotonic() + (STOP_GRACE_S if self._clean else 0)
            for p in self.group.workers:
                p.join(max(0.0, deadline - time.monotonic()))
        _abandon(self.group)


def _end_workers(workers) -> None:
    """SIGKILL: a worker holds nothing to flush, and a frozen one would ignore SIGTERM."""
    for p in workers:
        if p.is_alive():
            p.kill()
    for p in workers:
        p.join()


def _dead_workers(workers) -> str:
    return "; ".join(_describe_exit(i + 1, p.exitcode) for i, p in enumerate(workers) if p.exitcode is not None)


def _describe_exit(rank: int, code: int) -> str:
    if code < 0:
        return f"rank {rank} was killed by {signal.Signals(-code).name}"
    return f"rank {rank} exited with code {code}"


def _failure(group: RankGroup, when: str, seen: str | None = None) -> RankFailure:
    """Which rank broke the world, from the store and (when spawned) the processes."""
    found = []
    if group.workers:
        time.sleep(0.2)  # a killed rank's connection closes before its process is reaped
        found = [_describe_exit(i + 1, p.exitcode) for i, p in enumerate(group.workers)
                 if p.exitcode not in (None, 1)]  # 1: a rank that reported its error below
    if not found:
        for rank in range(1, group.world_size):
            key = f"{_KEY}error/{rank}"
            try:
                if group.store.check([key]):
                    found.append(f"rank {rank} failed: {group.store.get(key).decode(errors='replace')}")
            except Exception:
                break  # the store went away with its host
    if not found:
        found = _silent_ranks(group)
    if not found:
        found = [f"the other ranks are alive and reported no error (one is stuck in the step, which "
                 f"{TIMEOUT_ENV} bounds, or rank 0 itself failed)"]
    detail = f" (rank 0 saw {seen})" if seen else ""
    return RankFailure(f"k3-trt world of {group.world_size} ranks failed {when}: " + "; ".join(found) + detail)


def _silent_ranks(group: RankGroup) -> list[str]:
    """Ranks whose heartbeat stopped (killed on another host, or frozen)."""
    def beats():
        out = {}
        for rank in range(1, group.world_size):
            try:
                out[rank] = group.store.add(f"{_KEY}beat/{rank}", 0)
            except Exception:
                out[rank] = None
        return out

    before = beats()
    time.sleep(3 * HEARTBEAT_S)
    after = beats()
    return [f"rank {r} stopped responding (no heartbeat for {3 * HEARTBEAT_S:.1f} s)"
            for r in before if before[r] is None or before[r] == after[r]]


def _one_line(error: Exception) -> str:
    text = str(error).strip().splitlines()
    return text[0][:200] if text else type(error).__name__


# -- workers -----------------------------------------------------------------------

def worker_loop(executor, group: RankGroup) -> None:
    """Run the steps rank 0 broadcasts until it sends a stop."""
    store, rank = group.store, group.rank
    alive = threading.Event()
    threading.Thread(target=_heartbeat, args=(store, rank, alive), name="k3-heartbeat", daemon=True).start()
    header = torch.empty(HEADER_LEN, dtype=torch.int32)
    try:
        while True:
            dist.broadcast(header, 0, group=group.control)
            op, decode, num_copies, shapes = int(header[0]), bool(header[1]), int(header[2]), header[3:].tolist()
            if op == OP_STOP:
                break
            size = packed_numel(shapes)
            packed = torch.empty(size + 2 * num_copies, dtype=torch.int32, device=group.payload_device)
            dist.broadcast(packed, 0)
            if num_copies:
                executor.copy_states([tuple(p) for p in packed[size:].view(-1, 2).tolist()])
                packed = packed[:size]
            if op == OP_RUN:
                executor.execute(unpack_step(shapes, packed), decode)
            else:
                dist.barrier(group=group.control)  # OP_PROBE: acknowledge receipt
    except Exception as e:
        _report_error(store, rank, e)
        raise
    finally:
        alive.set()


def _heartbeat(store, rank: int, stop: threading.Event) -> None:
    while not stop.wait(HEARTBEAT_S):
        try:
            store.add(f"{_KEY}beat/{rank}", 1)
        except Exception:
            return  # the store's host is gone: the step broadcast fails too


def _report_error(store, rank: int, error: Exception) -> None:
    try:
        store.set(f"{_KEY}error/{rank}", f"{type(error).__name__}: {_one_line(error)}")
    except Exception:
        pass


# -- bench -------------------------------------------------------------------------

def step_broadcast_cost(engine, num_seqs: int = 256) -> dict | None:
    """``measure_step_broadcast`` for a multi-rank engine at ``num_seqs`` running sequences
    of ``max_seq_len`` tokens (the largest block tables); None at world size 1."""
    executor = engine.runner.executor
    if not isinstance(executor, BroadcastExecutor):
        return None
    cfg = engine.config
    seq_len = cfg.max_seq_len or cfg.num_blocks * cfg.block_size // num_seqs
    return measure_step_broadcast(executor, num_seqs, max(1, -(-seq_len // cfg.block_size)), cfg.block_size)


def measure_step_broadcast(executor: BroadcastExecutor, num_seqs: int, blocks_per_seq: int, block_size: int,
                           repeats: int = 20) -> dict:
    """Per-step cost of broadcasting a decode step of ``num_seqs`` running sequences, each
    with a block table of ``blocks_per_seq`` blocks: packing, header and payload, and the
    workers' acknowledgement (an upper bound: in a real step the model's first collective
    is that synchronisation), no model."""
    step = build_step([([1], blocks_per_seq * block_size - 1, i, list(range(blocks_per_seq)))
                       for i in range(num_seqs)], block_size)
    executor.probe_broadcast(step)  # first use of the payload size
    t0 = time.perf_counter()
    for _ in range(repeats):
        executor.probe_broadcast(step)
    seconds = (time.perf_counter() - t0) / repeats
    return {"running_sequences": num_seqs, "blocks_per_sequence": blocks_per_seq,
            "payload_bytes": pack_step(step).numel() * 4, "ms_per_step": seconds * 1e3,
            "world_size": executor.world_size, "backend": dist.get_backend()}
