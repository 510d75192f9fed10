"""LLMEngine: requests in, tokens out, one scheduler step at a time."""
from __future__ import annotations

import dataclasses
import random
import time
from collections import deque
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from k3_trtllm.checkpoint.detect import TRTLLM, checkpoint_format
from k3_trtllm.checkpoint.rank_layout import RankLayout, rank_layout_for
from k3_trtllm.checkpoint.trtllm import read_trtllm_config
from k3_trtllm.config import K3Config, load_config
from k3_trtllm.convert.in_memory import shard_hf_checkpoint
from k3_trtllm.model import K3Caches, Parallel, load_model, model_from_state_dict
from k3_trtllm.model.caches import kv_cache_label
from k3_trtllm.ops.cuda_library import register_cuda_kernels
from k3_trtllm.runtime.block_manager import BlockManager, PrefixCache, StateSlots, resolve_prefix_interval, size_pools
from k3_trtllm.runtime.distributed import RankSpec, check_world_one, rank_threads, start_world
from k3_trtllm.runtime.executor import Executor, TorchExecutor
from k3_trtllm.runtime.model_runner import ModelRunner
from k3_trtllm.runtime.sampler import Sampler, SamplingParams
from k3_trtllm.runtime.scheduler import Scheduler
from k3_trtllm.runtime.sequence import Sequence
from k3_trtllm.runtime.tokenizer import Tokenizer, load_tokenizer

Prompt = str | list[int]

# Per-step samples kept for percentiles; a long-lived engine keeps only the latest.
_WINDOW = 100_000


def summarize(values, scale: float = 1.0) -> dict[str, float] | None:
    """Mean and p50/p90/p99 (nearest rank) of ``values`` times ``scale``; None if empty."""
    data = sorted(v * scale for v in values if v is not None)
    if not data:
        return None
    def rank(p: float) -> float:
        return data[min(len(data) - 1, max(0, round(p / 100 * len(data)) - 1))]
    return {"mean": sum(data) / len(data), "p50": rank(50), "p90": rank(90), "p99": rank(99), "max": data[-1]}


@dataclass
class EngineStats:
    num_steps: int = 0
    computed_tokens: int = 0  # tokens run through the model, recomputed ones included
    generated_tokens: int = 0
    peak_blocks_in_use: int = 0
    peak_slots_in_use: int = 0
    peak_batch: int = 0
    first_step_time: float | None = None
    last_step_time: float | None = None
    scheduler_cpu_s: deque = field(default_factory=lambda: deque(maxlen=_WINDOW))
    step_wall_s: deque = field(default_factory=lambda: deque(maxlen=_WINDOW))
    batch_per_step: deque = field(default_factory=lambda: deque(maxlen=_WINDOW))


@dataclass(frozen=True)
class EngineConfig:
    num_blocks: int
    max_slots: int
    block_size: int = 16
    max_batch_size: int = 64
    max_num_tokens: int = 2048
    max_seq_len: int | None = None  # prompt + output tokens of one request; None: the pool bounds it
    # Prefix cache (runtime/block_manager.py: PrefixCache): shared full blocks + KDA state snapshots
    # every prefix_cache_interval tokens (0: DEFAULT_PREFIX_CACHE_INTERVAL) in snapshot_slots rows
    # after the max_slots running ones (None: max_slots); the executor must hold that many rows.
    prefix_cache: bool = False
    prefix_cache_interval: int = 0
    snapshot_slots: int | None = None
    # what the executor's latent rows hold (model/caches.py: kv_cache_label), "fp8" or the
    # activation dtype's name, as build_engine states it (None: not stated); only reported
    kv_cache_dtype: str | None = None
    # bytes of one KDA state row on this rank (a snapshot row is one): what the snapshot pools
    # hold, for the reports (0: not stated)
    state_row_bytes: int = 0


@dataclass(frozen=True)
class RequestOutput:
    """Tokens one request produced in one step."""

    request_id: int
    new_token_ids: list[int]
    finished: bool
    finish_reason: str | None = None
    new_log_probs: list[float] | None = None  # when the request's sampling asked for log-probs
    cached_tokens: int = 0  # prompt tokens its first admission took from the prefix cache


@dataclass(frozen=True)
class CompletedRequest:
    request_id: int
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    text: str | None
    finish_reason: str
    ttft_s: float | None
    tpot_s: float | None
    num_preemptions: int
    output_log_probs: list[float] | None = None  # when the request's sampling asked for log-probs
    cached_tokens: int = 0  # prompt tokens its first admission took from the prefix cache (not computed)


class LLMEngine:
    """Inflight batching: a request added between steps joins the next one, a finished
    one frees its blocks and state slot at once. Not thread-safe: call it from one
    thread (a server wraps it in a loop)."""

    def __init__(self, executor: Executor, config: EngineConfig, *, eos_token_ids: Iterable[int] = (),
                 tokenizer: Tokenizer | None = None, seed: int | None = None, clock=time.perf_counter) -> None:
        self.config = config
        self.tokenizer = tokenizer
        self.eos_token_ids = tuple(eos_token_ids)
        blocks = BlockManager(config.num_blocks, config.block_size)
        prefix = None
        if config.prefix_cache:
            snapshots = config.max_slots if config.snapshot_slots is None else config.snapshot_slots
            prefix = PrefixCache(blocks, config.max_slots, snapshots,
                                 resolve_prefix_interval(config.prefix_cache_interval, config.block_size),
                                 mid_chunk=getattr(executor, "writes_snapshots", False))
        self.scheduler = Scheduler(blocks, StateSlots(config.max_slots), config.max_batch_size,
                                   config.max_num_tokens, self.eos_token_ids, prefix)
        self.runner = ModelRunner(executor, config.block_size, first_snapshot_row=config.max_slots)
        self.vocab_size = executor.vocab_size
        self.sampler = Sampler(self.eos_token_ids)
        # Requests without a seed get one from here, in arrival order, so that an
        # engine seed makes a whole run reproducible.
        self._seeds = random.Random(seed) if seed is not None else None
        self.clock = clock
        self.stats = EngineStats()
        self._next_id = 0
        self._unfinished: dict[int, Sequence] = {}
        self._finished: dict[int, Sequence] = {}

    # -- requests ------------------------------------------------------------------

    def add_request(self, prompt: Prompt, sampling: SamplingParams | None = None,
                    arrival_time: float | None = None) -> int:
        """Queue a request (text needs the tokenizer); it joins the next step.
        ``arrival_time`` (engine clock) backdates it, for latency accounting."""
        ids = self._encode(prompt)
        sampling = sampling or SamplingParams()
        self.sampler.check(sampling, self.vocab_size)
        limit = self.config.max_seq_len
        if limit is not None and len(ids) + sampling.max_new_tokens > limit:
            raise ValueError(f"prompt of {len(ids)} tokens + max_new_tokens {sampling.max_new_tokens} exceeds "
                             f"max_seq_len {limit}")
        if sampling.seed is None and self._seeds is not None and not sampling.is_greedy:
            sampling = dataclasses.replace(sampling, seed=self._seeds.getrandbits(63))
        seq = Sequence(self._next_id, ids, sampling, self.clock() if arrival_time is None else arrival_time)
        self.scheduler.add(seq)
        self._next_id += 1
        self._unfinished[seq.seq_id] = seq
        return seq.seq_id

    def abort(self, request_id: int) -> bool:
        """Stop a request now; its blocks and slot are free for the next step. Returns
        False when it is unknown or already finished."""
        seq = self._unfinished.pop(request_id, None)
        if seq is None:
            return False
        self.scheduler.abort(seq, self.clock())
        self._finished[request_id] = seq
        return True

    def has_unfinished(self) -> bool:
        return bool(self._unfinished)

    def take_result(self, request_id: int) -> CompletedRequest:
        """The result of a finished request (the engine forgets it afterwards)."""
        seq = self._finished.pop(request_id, None)
        if seq is None:
            state = "unfinished" if request_id in self._unfinished else "unknown"
            raise ValueError(f"request {request_id} is {state}")
        out = seq.output_token_ids
        if seq.finish_reason in ("stop", "eos"):
            out_text_ids = out[:-1]  # the stop token is in the ids but not in the text
        else:
            out_text_ids = out
        return CompletedRequest(
            request_id=seq.seq_id, prompt_token_ids=seq.prompt_token_ids, output_token_ids=out,
            text=self.tokenizer.decode(out_text_ids) if self.tokenizer else None,
            finish_reason=seq.finish_reason, ttft_s=seq.ttft_s, tpot_s=seq.tpot_s,
            num_preemptions=seq.num_preemptions,
            output_log_probs=list(seq.output_logprobs) if seq.sampling.logprobs else None,
            cached_tokens=seq.prefix_cached_tokens)

    def _encode(self, prompt: Prompt) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("a text prompt needs a tokenizer; pass token ids instead")
            ids = self.tokenizer.encode(prompt)
        else:
            ids = [int(t) for t in prompt]
        if not ids:
            raise ValueError("prompt is empty")
        bad = [t for t in ids if not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(f"prompt token ids {bad[:5]} are outside the vocabulary [0, {self.vocab_size})")
        return ids

    # -- stepping ------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Run one step; return the tokens each request gained (at most one each)."""
        stats = self.stats
        wall0, cpu0 = self.clock(), time.thread_time()
        batch = self.scheduler.schedule()
        cpu_schedule = time.thread_time() - cpu0
        if not batch:
            if self.scheduler.has_unfinished():
                raise RuntimeError("the scheduler found nothing to run for the unfinished requests")
            return []
        logits = self.runner.run(batch)
        tokens = self.sampler.sample(logits, batch.sampling)
        cpu1 = time.thread_time()
        now = self.clock()
        results = self.scheduler.postprocess(batch, tokens, now)
        stats.scheduler_cpu_s.append(cpu_schedule + time.thread_time() - cpu1)
        stats.step_wall_s.append(now - wall0)
        stats.batch_per_step.append(len(batch.entries))
        stats.num_steps += 1
        stats.computed_tokens += batch.num_tokens
        stats.generated_tokens += len(tokens)
        stats.first_step_time = wall0 if stats.first_step_time is None else stats.first_step_time
        stats.last_step_time = now
        blocks, slots = self.scheduler.blocks, self.scheduler.slots
        stats.peak_blocks_in_use = max(stats.peak_blocks_in_use, blocks.num_used)
        stats.peak_slots_in_use = max(stats.peak_slots_in_use, slots.num_used)
        stats.peak_batch = max(stats.peak_batch, len(batch.entries))
        outputs = []
        for r in results:
            rid = r.seq.seq_id
            if r.finished:
                self._finished[rid] = self._unfinished.pop(rid)
            log_probs = r.seq.output_logprobs[-1:] if r.seq.sampling.logprobs else None
            outputs.append(RequestOutput(rid, [r.new_token_id], r.finished, r.seq.finish_reason, log_probs,
                                         r.seq.prefix_cached_tokens))
        return outputs

    def follow(self, request_ids: Iterable[int]) -> Iterator[RequestOutput]:
        """Step until the given requests finish (or are aborted), yielding their tokens
        as they come; other requests in flight advance too."""
        pending = set(request_ids)
        while pending:
            for out in self.step():
                if out.request_id in pending:
                    yield out
            pending &= self._unfinished.keys()

    def stream(self, prompts: Iterable[Prompt],
               sampling: SamplingParams | list[SamplingParams] | None = None) -> Iterator[RequestOutput]:
        """Add ``prompts`` (request ids are handed out in prompt order) and yield their
        tokens as steps produce them."""
        yield from self.follow(self._add_all(prompts, sampling))

    def generate(self, prompts: Iterable[Prompt],
                 sampling: SamplingParams | list[SamplingParams] | None = None) -> list[CompletedRequest]:
        """Run ``prompts`` to completion, batched inflight; results in prompt order."""
        ids = self._add_all(prompts, sampling)
        for _ in self.follow(ids):
            pass
        return [self.take_result(rid) for rid in ids]

    def _add_all(self, prompts, sampling) -> list[int]:
        prompts = list(prompts)
        if isinstance(sampling, list):
            if len(sampling) != len(prompts):
                raise ValueError(f"got {len(sampling)} sampling params for {len(prompts)} prompts")
            per_prompt = sampling
        else:
            per_prompt = [sampling] * len(prompts)
        return [self.add_request(p, s) for p, s in zip(prompts, per_prompt)]

    # -- stats ---------------------------------------------------------------------

    def close(self) -> None:
        """Stop the other ranks of a multi-rank engine (nothing to do at world size 1)."""
        close = getattr(self.runner.executor, "close", None)
        if close is not None:
            close()

    def reset_stats(self) -> None:
        self.stats = EngineStats()
        self.scheduler.num_preemptions = 0
        self.scheduler.blocks.num_evicted = 0
        if self.scheduler.prefix is not None:
            self.scheduler.prefix.reset_counters()  # what is cached stays cached

    def summary(self) -> dict:
        stats = self.stats
        blocks, slots = self.scheduler.blocks, self.scheduler.slots
        elapsed = None
        if stats.first_step_time is not None:
            elapsed = stats.last_step_time - stats.first_step_time
        return {
            "steps": stats.num_steps,
            "computed_tokens": stats.computed_tokens,
            "generated_tokens": stats.generated_tokens,
            "elapsed_s": elapsed,
            "generated_tokens_per_s": stats.generated_tokens / elapsed if elapsed else None,
            "preemptions": self.scheduler.num_preemptions,
            "blocks": {"total": blocks.num_blocks, "in_use": blocks.num_used, "peak": stats.peak_blocks_in_use},
            "slots": {"total": slots.max_slots, "in_use": slots.num_used, "peak": stats.peak_slots_in_use},
            "peak_batch": stats.peak_batch,
            "kv_cache_dtype": self.config.kv_cache_dtype,
            "prefix_cache": self._prefix_summary(),
            "scheduler_cpu_ms_per_step": summarize(stats.scheduler_cpu_s, 1e3),
            "step_ms": summarize(stats.step_wall_s, 1e3),
        }


    def _prefix_summary(self) -> dict:
        p, blocks = self.scheduler.prefix, self.scheduler.blocks
        if p is None:
            return {"enabled": False, "interval": 0, "queries": 0, "hits": 0, "cached_tokens": 0,
                    "snapshots_taken": 0, "snapshots_in_use": 0, "evicted_blocks": 0, "evicted_snapshots": 0,
                    "cached_blocks": 0, "snapshot_slots": 0, "snapshot_bytes": 0}
        return {"enabled": True, "interval": p.interval, "queries": p.queries, "hits": p.hits,
                "cached_tokens": p.cached_tokens, "snapshots_taken": p.snapshots_taken,
                "snapshots_in_use": p.snapshots_in_use, "evicted_blocks": blocks.num_evicted,
                "evicted_snapshots": p.evicted_snapshots, "cached_blocks": blocks.num_cached,
                "snapshot_slots": p.snapshot_slots, "snapshot_bytes": p.snapshot_slots * self.config.state_row_bytes}


def snapshot_rows_notice(engine: LLMEngine, *, num_blocks: int | None, max_slots: int | None,
                         cache_memory_gb: float | None, snapshot_slots: int | None) -> str | None:
    """The one stderr line for snapshot rows that ``size_pools`` chose beside pool counts the
    user gave (both counts, no budget, no ``--prefix-cache-snapshots``): memory nobody sized,
    so it is said, with the flags that change it; None otherwise."""
    prefix = engine.scheduler.prefix
    if prefix is None or snapshot_slots is not None or cache_memory_gb is not None \
            or num_blocks is None or max_slots is None:
        return None
    rows, mib = prefix.snapshot_slots, prefix.snapshot_slots * engine.config.state_row_bytes / (1 << 20)
    return (f"k3-trt: prefix cache: {rows} KDA state snapshot row{'s' if rows != 1 else ''} ({mib:.1f} MiB per "
            f"rank) beside --num-blocks {num_blocks} / --max-slots {max_slots} (one per state slot, at most one "
            f"per --prefix-cache-interval {prefix.interval} of the blocks); --prefix-cache-snapshots N sets them, "
            "--no-prefix-cache drops them")


def build_engine(model_dir: str, *, dtype: torch.dtype = torch.bfloat16, device: str = "cpu",
                 block_size: int = 16, max_batch_size: int = 64, max_num_tokens: int = 2048,
                 max_seq_len: int = 4096, num_blocks: int | None = None, max_slots: int | None = None,
                 cache_memory_gb: float | None = None, seed: int | None = None, tp: int | None = None,
                 ep: int | None = None, batch_invariant: bool = False, prefix_cache: bool = False,
                 prefix_cache_interval: int | None = None, snapshot_slots: int | None = None,
                 kv_cache_dtype: str = "auto") -> LLMEngine | None:
    """Load a checkpoint, size and allocate its cache pools, and wrap it in an engine.

    At world size N > 1 (a converted world-N checkpoint, or an HF one with ``tp`` > 1,
    sharded at load as the converter shards it) every rank holds its shard and its pools;
    this process is rank 0 and holds the engine, and the other ranks are the ones
    ``torchrun`` started or, without it, processes started here (runtime/distributed.py).
    On those other ranks under ``torchrun`` this serves steps until rank 0 closes its
    engine, then returns None.

    ``batch_invariant``: on CUDA, a request's output does not depend on the rest of its batch
    (``kernels.batch_invariant``; slower, and decode runs without CUDA graphs); the CPU
    reference ops are batch-invariant already.

    ``prefix_cache``: share cached prefixes between requests (``runtime/block_manager.py``:
    ``PrefixCache``), with a KDA state snapshot every ``prefix_cache_interval`` tokens in
    ``snapshot_slots`` rows (None: ``size_pools`` sizes them); every rank keeps its own heads'
    snapshots and rank 0 decides the hits.

    ``kv_cache_dtype``: the latent rows (``model/caches.py``: auto, bf16 or fp8); the cache
    budget counts their real bytes, so fp8 fits about 1.76x the blocks of bf16 for K3."""
    label = kv_cache_label(kv_cache_dtype, dtype)  # a bad value fails before the checkpoint is read
    cfg, tp, ep = _checkpoint_layout(model_dir, tp, ep)
    interval = resolve_prefix_interval(prefix_cache_interval, block_size) if prefix_cache else 0
    row_bytes = K3Caches.bytes_per_slot(cfg, dtype, tp)
    pools = size_pools(K3Caches.bytes_per_block(cfg, block_size, dtype, kv_cache_dtype), row_bytes,
                       block_size=block_size, max_batch_size=max_batch_size, max_seq_len=max_seq_len,
                       cache_memory_gb=cache_memory_gb, num_blocks=num_blocks, max_slots=max_slots,
                       prefix_cache=prefix_cache, snapshot_slots=snapshot_slots, prefix_cache_interval=interval)
    spec = RankSpec(str(model_dir), dtype, torch.device(device).type, tp, ep, pools.num_blocks, pools.max_slots,
                    block_size, threads=rank_threads(tp), batch_invariant=batch_invariant,
                    snapshot_slots=pools.snapshot_slots, kv_cache_dtype=kv_cache_dtype)
    config = EngineConfig(num_blocks=pools.num_blocks, max_slots=pools.max_slots, block_size=block_size,
                          max_batch_size=max_batch_size, max_num_tokens=max_num_tokens, max_seq_len=max_seq_len,
                          prefix_cache=prefix_cache, prefix_cache_interval=interval,
                          snapshot_slots=pools.snapshot_slots, kv_cache_dtype=label, state_row_bytes=row_bytes)
    return start_engine(spec, _rank_executor, cfg, config, device, model_dir, seed)


def start_engine(spec: RankSpec, make_executor, cfg: K3Config, config: EngineConfig, device: str,
                 tokenizer_dir, seed: int | None) -> LLMEngine | None:
    """This rank's executor from ``make_executor(spec, device)`` (at world size > 1 on every
    rank, started or joined by ``start_world``) and, on rank 0, the engine over it with the
    tokenizer of ``tokenizer_dir``; None on a torchrun rank other than 0, once rank 0 has
    closed its engine. One path for checkpoints and engine dirs."""
    if spec.tp == 1:
        check_world_one(spec.model_dir)
        executor = make_executor(spec, torch.device(device))
    else:
        executor = start_world(spec, spec.tp, make_executor)
        if executor is None:
            return None
    eos = cfg.eos_token_id
    eos_ids = () if eos is None else tuple(eos) if isinstance(eos, (list, tuple)) else (eos,)
    return LLMEngine(executor, config, eos_token_ids=eos_ids, tokenizer=load_tokenizer(tokenizer_dir), seed=seed)


def _checkpoint_layout(model_dir, tp: int | None, ep: int | None) -> tuple[K3Config, int, int]:
    """(config, tp, ep): a converted checkpoint's mapping fixes tp and ep; an HF
    one is sharded at load with ``tp``/``ep`` (default 1), validated as the converter does."""
    if checkpoint_format(model_dir) == TRTLLM:
        cfg, data = read_trtllm_config(model_dir)
        layout = RankLayout.from_mapping_json(data["mapping"], cfg, f"{model_dir}/config.json")
        if (tp or layout.tp, ep or layout.ep) != (layout.tp, layout.ep):
            raise ValueError(f"--tp {tp or layout.tp} --ep {ep or layout.ep}: {model_dir} is converted for tp "
                             f"{layout.tp}, ep {layout.ep} (its rank files fix them; leave --tp/--ep out)")
        return cfg, layout.tp, layout.ep
    cfg = load_config(model_dir)
    layout = rank_layout_for(cfg, tp or 1, ep or 1, cfg.moe is not None and cfg.moe.mxfp4)
    return cfg, layout.tp, layout.ep


def _rank_executor(spec: RankSpec, device: torch.device) -> TorchExecutor:
    """This rank's model shard and cache pools (module level: spawned ranks unpickle it)."""
    if spec.batch_invariant and device.type == "cuda":
        from k3_trtllm.ops.batch_invariant import set_batch_invariant

        set_batch_invariant(True)  # before the model loads: the MoE/MLA kernels read it at each launch
    if spec.tp == 1 or checkpoint_format(spec.model_dir) == TRTLLM:
        model = load_model(spec.model_dir, dtype=spec.dtype, device=device)
    else:
        if device.type == "cuda":
            register_cuda_kernels()
        cfg, state, layout = shard_hf_checkpoint(spec.model_dir, spec.tp, spec.ep, dist.get_rank())
        model = model_from_state_dict(cfg, state, spec.dtype, device, Parallel.from_layout(layout, dist.get_rank()))
    caches = model.allocate_caches(spec.num_blocks, spec.block_size, spec.max_slots, spec.kv_cache_dtype)
    caches.allocate_snapshots(spec.snapshot_slots)
    # the mode's row-chunked overrides are proven eager only (tests/gpu/test_determinism.py)
    return TorchExecutor(model, caches, device, cuda_graphs=False if spec.batch_invariant else None)
