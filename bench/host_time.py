#!/usr/bin/env python3
"""Host time of the eager steps, and where it goes (issue 20's host goal, issue 22's cache-hit TTFT).

    python bench/host_time.py --config ../shared/k3/config.json --out bench/results/host_time_h200.json
    python bench/host_time.py --device cpu --config examples/tiny-k3/config.json --tp 2 --ep 2 \\
        --layers 4 --context 64 --no-tiny          # the same code at tiny dims

Cases (each through ``TorchExecutor`` as the runner drives it, steps built on the host by
``build_step``):

- ``slice_decode_b<B>``: a pure-decode step of one TP/EP rank's slice (``bench/rank_slice.py``'s
  random rank) at ``--context`` cached tokens, eager;
- ``slice_prefill_hit``: ``--prefill-tokens`` new tokens after ``--context`` cached ones (the step a
  prefix-cache hit runs), eager;
- ``tiny_decode_b<B>`` / ``tiny_prefill``: the shipped tiny K3 (examples/tiny-k3), eager and, for
  decode on a GPU, through the executor's CUDA graphs;
- ``engine_decode_b<B>`` (``--engine-batches``): the host time of a whole decode step of the tiny
  model's engine (issue 20's "host time per step"), B sequences at ``--engine-context`` tokens:
  its parts as ``LLMEngine.step`` runs them (scheduler, model runner with ``build_step``, the
  executor's host side: a CUDA-graph replay on a GPU, the whole forward on the CPU, sampling,
  postprocess), each timed with the device drained before it, so none waits for the GPU;
  ``--engine-no-forward``: fixed logits in place of the model's (the host path alone).

Each case reports the host time of one step (median, the device drained first, as
``rank_slice.host_ms``), the step's device time (CUDA events, back to back), kernel launches per
step (torch profiler), and a cProfile of ``--profile-steps`` steps: the functions by own time and
the time by source file, per step. cProfile's own overhead inflates every figure in it; use it
for where the time goes, and ``host_ms`` for how much there is."""
from __future__ import annotations

import argparse
import cProfile
import pstats
import statistics
import sys
import time
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout

from bench.rank_slice import (BenchError, PoolLayout, bench_device, build_rank, commit_id, host_ms,  # noqa: E402
                              make_step, profile_step, rank_parallel, read_config_json, slice_config, time_ms,
                              write_json)
from k3_trtllm.model import build_step, load_model  # noqa: E402
from k3_trtllm.model.step import is_pure_decode  # noqa: E402
from k3_trtllm.runtime.engine import build_engine  # noqa: E402
from k3_trtllm.runtime.executor import TorchExecutor  # noqa: E402
from k3_trtllm.runtime.sequence import SamplingParams  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "examples" / "tiny-k3"


def _where(path: str) -> str:
    """A source path as short as it is unambiguous: repo-relative, else from its site-packages."""
    p = str(path)
    for marker in (str(ROOT) + "/", "site-packages/", "lib/python"):
        if marker in p:
            return p.split(marker, 1)[1]
    return p


def cprofile_step(fn, device: torch.device, steps: int, top: int) -> dict:
    """``fn`` called ``steps`` times under cProfile (the device drained between calls, outside the
    profile): per step, the ``top`` functions by own time and every source file's own time."""
    fn()
    _drain(device)
    prof = cProfile.Profile()
    for _ in range(steps):
        prof.enable()
        fn()
        prof.disable()
        _drain(device)
    stats = pstats.Stats(prof).stats
    rows, by_file = [], {}
    for (path, line, name), (_, ncalls, tottime, cumtime, _) in stats.items():
        where = _where(path)
        rows.append({"function": f"{where}:{line}({name})", "calls_per_step": ncalls / steps,
                     "own_us_per_step": tottime / steps * 1e6, "cum_us_per_step": cumtime / steps * 1e6})
        key = where if line else "(builtins and C functions)"
        by_file[key] = by_file.get(key, 0.0) + tottime / steps * 1e6
    rows.sort(key=lambda r: -r["own_us_per_step"])
    total = sum(by_file.values())
    files = sorted(by_file.items(), key=lambda kv: -kv[1])[:top]
    return {"profiled_us_per_step": total, "top_functions": rows[:top],
            "by_file_us": [{"file": f, "own_us_per_step": us} for f, us in files]}


def cpu_ops(fn, device: torch.device, steps: int = 3, top: int = 20) -> list[dict]:
    """The torch profiler's CPU side over ``steps`` calls: the ``top`` ops (aten ops, CUDA runtime
    calls) by self CPU time, per step."""
    fn()
    _drain(device)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], acc_events=True) as prof:
        for _ in range(steps):
            fn()
        _drain(device)
    rows = sorted(prof.key_averages(), key=lambda e: -e.self_cpu_time_total)[:top]
    return [{"op": e.key[:120], "calls_per_step": e.count / steps, "self_us_per_step": e.self_cpu_time_total / steps}
            for e in rows]


def _drain(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure(executor: TorchExecutor, step, decode: bool, args, graphs: bool = False) -> dict:
    """One case: host ms, device ms, launches, cProfile (of the eager executor; ``graphs``: also
    the executor's CUDA-graph replay of the step, host and device time)."""
    device = executor.device

    def run():
        return executor.execute(step, decode)
    out = {"tokens": step.num_tokens, "seqs": step.num_seqs, "decode": decode,
           "host_ms": host_ms(run, device, args.iters),
           "step_ms": time_ms(run, device, args.iters, args.warmup)}
    if device.type == "cuda":
        out["launches_per_step"] = profile_step(run, device, steps=3, top=0)["launches_per_step"]
    out["cprofile"] = cprofile_step(run, device, args.profile_steps, args.top)
    out["cpu_ops"] = cpu_ops(run, device)
    if graphs and device.type == "cuda":
        graph = TorchExecutor(executor.model, executor.caches, device, cuda_graphs=True)
        out["graph_step_ms"] = time_ms(lambda: graph.execute(step, decode), device, args.iters, 3)
        out["graph_host_ms"] = host_ms(lambda: graph.execute(step, decode), device, args.iters)
        out["graph_replays"] = graph.graph_replays
    return out


def slice_cases(data: dict, source: str, device: torch.device, args) -> dict:
    cfg = slice_config(data, args.layers, source)
    par = rank_parallel(cfg, args.tp, args.ep)
    layout = PoolLayout(max(args.batches), args.context + args.prefill_tokens + 1, args.block_size)
    model, caches = build_rank(cfg, par, layout, device, args.seed)
    executor = TorchExecutor(model, caches, device, cuda_graphs=False)
    gen = torch.Generator().manual_seed(args.seed)
    vocab = par.tp_local(cfg.vocab_size)
    cases = {}
    for batch in args.batches:
        step, decode = make_step([(1, args.context)] * batch, layout, vocab, gen)
        cases[f"slice_decode_b{batch}"] = measure(executor, step, decode, args)
        print(_line(f"slice decode B{batch}", cases[f"slice_decode_b{batch}"]), flush=True)
    if args.prefill_tokens:
        step, decode = make_step([(args.prefill_tokens, args.context)], layout, vocab, gen)
        cases["slice_prefill_hit"] = measure(executor, step, decode, args)
        print(_line(f"slice prefill {args.prefill_tokens} after {args.context}", cases["slice_prefill_hit"]),
              flush=True)
    del executor, model, caches
    return cases


def tiny_cases(device: torch.device, args) -> dict:
    model = load_model(args.tiny, torch.bfloat16, device)
    block_size, context = 16, args.tiny_context
    blocks = -(-(context + args.prefill_tokens + 1) // block_size)
    batches = sorted(set(args.batches) | {1})
    caches = model.allocate_caches(blocks * max(batches), block_size, max(batches))
    executor = TorchExecutor(model, caches, device, cuda_graphs=False)
    vocab = model.config.vocab_size
    gen = torch.Generator().manual_seed(args.seed)

    def seqs(batch, new, ctx):
        return [(torch.randint(3, vocab, (new,), generator=gen).tolist(), ctx, i,
                 list(range(i * blocks, (i + 1) * blocks))) for i in range(batch)]
    cases = {}
    for batch in batches:
        s = seqs(batch, 1, context)
        step = build_step(s, block_size)
        cases[f"tiny_decode_b{batch}"] = measure(executor, step, is_pure_decode(s), args, graphs=True)
        print(_line(f"tiny decode B{batch}", cases[f"tiny_decode_b{batch}"]), flush=True)
    if args.prefill_tokens:
        s = seqs(1, args.prefill_tokens, context)
        cases["tiny_prefill"] = measure(executor, build_step(s, block_size), is_pure_decode(s), args)
        print(_line(f"tiny prefill {args.prefill_tokens} after {context}", cases["tiny_prefill"]), flush=True)
    return cases


ENGINE_PARTS = ("schedule", "runner", "execute", "sample", "postprocess")


def engine_case(device: torch.device, batch: int, args) -> dict:
    """Per-part host ms (median of ``--iters`` decode steps) of the tiny model's engine at ``batch``
    sequences of ``--engine-context`` tokens, block size 64 (the K3 engines'); on a GPU the decode
    steps replay CUDA graphs (the first steps of a shape, its capture, run before the timed ones)."""
    block, ctx, max_tokens = 64, args.engine_context, min(batch * args.engine_context, 16384)
    # the first sequences admitted decode while the later ones prefill: room for their tokens too
    steps = args.warmup + args.iters + 4 + -(-batch * ctx // max_tokens)
    blocks = -(-(ctx + steps + 1) // block)
    engine = build_engine(args.tiny, dtype=getattr(torch, args.engine_dtype), device=str(device), block_size=block,
                          max_batch_size=batch, max_num_tokens=max_tokens, max_seq_len=blocks * block,
                          num_blocks=batch * blocks, max_slots=batch)
    sched, runner, sampler = engine.scheduler, engine.runner, engine.sampler
    gen = torch.Generator().manual_seed(args.seed)
    vocab = engine.vocab_size
    params = SamplingParams(max_new_tokens=steps, temperature=0.0, ignore_eos=True)
    for _ in range(batch):
        engine.add_request(torch.randint(3, vocab, (ctx,), generator=gen).tolist(), params)
    while len(sched.running) < batch or any(s.num_uncached_tokens != 1 for s in sched.running):
        engine.step()  # the prefills
    executor = runner.executor
    real, spent = executor.execute, []
    fixed = torch.zeros(batch, vocab, device=device)

    def inner(step, decode):
        # --engine-no-forward: the host path alone, as on a GPU, where the host runs no forward
        return fixed if args.engine_no_forward else real(step, decode)

    def timed_execute(step, decode):
        t = time.perf_counter()
        out = inner(step, decode)
        spent.append(time.perf_counter() - t)
        return out
    executor.execute = timed_execute
    parts = {k: [] for k in ENGINE_PARTS}
    replays = getattr(executor, "graph_replays", 0)
    try:
        for i in range(args.warmup + args.iters):
            _drain(device)
            t0 = time.perf_counter()
            batch_ = sched.schedule()
            t1 = time.perf_counter()
            logits = runner.run(batch_)
            t2 = time.perf_counter()
            _drain(device)
            t3 = time.perf_counter()
            tokens = sampler.sample(logits, batch_.sampling)
            t4 = time.perf_counter()
            sched.postprocess(batch_, tokens, t4)
            t5 = time.perf_counter()
            if len(batch_.entries) != batch or any(n != 1 for _, n in batch_.entries):
                raise BenchError(f"engine case B{batch}: a timed step ran {batch_.num_tokens} tokens of "
                                 f"{len(batch_.entries)} sequences, not {batch} decodes")
            if i >= args.warmup:
                execute = spent[-1]
                for k, v in zip(ENGINE_PARTS, (t1 - t0, t2 - t1 - execute, execute, t4 - t3, t5 - t4)):
                    parts[k].append(v * 1e3)
    finally:
        executor.execute = real
    med = {k: statistics.median(v) for k, v in parts.items()}
    out = {"batch": batch, "context": ctx, "iters": args.iters, "forward": not args.engine_no_forward,
           "parts_ms": med,
           "host_ms": sum(med.values()), "host_ms_without_execute": sum(v for k, v in med.items() if k != "execute"),
           "graph_replays": getattr(executor, "graph_replays", 0) - replays}
    engine.close()
    return out


def _engine_line(r: dict) -> str:
    parts = ", ".join(f"{k} {v:.3f}" for k, v in r["parts_ms"].items())
    return (f"engine decode B{r['batch']} ctx {r['context']}: host {r['host_ms']:.3f} ms "
            f"({r['host_ms_without_execute']:.3f} without execute; {parts}; {r['graph_replays']} replays)")


def _line(name: str, r: dict) -> str:
    graph = f", graph step {r['graph_step_ms']['median_ms']:.3f} ms host {r['graph_host_ms']:.3f} ms" \
        if "graph_step_ms" in r else ""
    launches = f", {r['launches_per_step']:.0f} launches" if "launches_per_step" in r else ""
    top = ", ".join(f"{f['file']} {f['own_us_per_step']:.0f}" for f in r["cprofile"]["by_file_us"][:6])
    return (f"{name}: host {r['host_ms']:.3f} ms, step {r['step_ms']['median_ms']:.3f} ms{launches}{graph}; "
            f"cProfile us/step by file: {top}")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default=str(ROOT.parent / "shared" / "k3" / "config.json"))
    p.add_argument("--tp", type=int, default=8)
    p.add_argument("--ep", type=int, default=8)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--batches", type=lambda s: [int(v) for v in s.split(",")], default=[1])
    p.add_argument("--context", type=int, default=4096, help="cached tokens of the slice's sequences")
    p.add_argument("--tiny", default=str(TINY), help="the tiny model's checkpoint (default examples/tiny-k3)")
    p.add_argument("--tiny-context", type=int, default=64)
    p.add_argument("--prefill-tokens", type=int, default=32, help="new tokens of the prefill (cache-hit) step")
    p.add_argument("--block-size", type=int, default=64)
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--profile-steps", type=int, default=10)
    p.add_argument("--top", type=int, default=40)
    p.add_argument("--engine-batches", type=lambda s: [int(v) for v in s.split(",") if v], default=[],
                   help="batch sizes of the engine_decode_b<B> cases (default: none)")
    p.add_argument("--engine-context", type=int, default=2048, help="cached tokens of those sequences")
    p.add_argument("--engine-dtype", default="bfloat16", choices=["bfloat16", "float32"],
                   help="the engine's dtype (float32 runs the CPU reference ops faster)")
    p.add_argument("--engine-no-forward", action="store_true",
                   help="time the engine's decode steps with fixed logits in place of the model (on the CPU the "
                        "reference forward leaves the caches cold for the host code after it)")
    p.add_argument("--no-slice", action="store_true")
    p.add_argument("--no-tiny", action="store_true")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        device = bench_device(args.device)
        report = {"meta": {"commit": commit_id(), "device": torch.cuda.get_device_name(device)
                           if device.type == "cuda" else "cpu", "torch": torch.__version__, "args": vars(args)}}
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            with torch.inference_mode():
                if not args.no_slice:
                    report.update(slice_cases(read_config_json(Path(args.config)), args.config, device, args))
                if not args.no_tiny:
                    report.update(tiny_cases(device, args))
            for batch in args.engine_batches:  # the engine's own steps (it enters inference mode itself)
                report[f"engine_decode_b{batch}"] = r = engine_case(device, batch, args)
                print(_engine_line(r), flush=True)
        report["warnings"] = sorted({f"{w.category.__name__}: {w.message}" for w in seen})
        for w in report["warnings"]:
            print("warning:", w, file=sys.stderr)
    except BenchError as e:
        print(f"host_time.py: {e}", file=sys.stderr)
        return 2
    if args.out:
        write_json(args.out, report)
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
