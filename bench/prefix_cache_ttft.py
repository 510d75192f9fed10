#!/usr/bin/env python3
"""TTFT with a cached 4k-token prefix vs uncached, and bf16 agreement of the two (issue 22).

    python bench/prefix_cache_ttft.py --config .carry/k3/config.json --layers 8 \\
        --out bench/results/prefix_cache_ttft_h200.json
    python bench/prefix_cache_ttft.py --device cpu --config examples/tiny-k3/config.json --shapes 1:1,2:2 \\
        --layers 4 --prefix-len 128 --suffix-len 8 --new-tokens 4 --block-size 16 --interval 64  # tiny

The model is a K3 rank slice as ``bench/rank_slice.py`` builds it (the config's first
``--layers`` layers in K3's own KDA/MLA and dense/MoE pattern, at one rank's dims of each
``--shapes`` TP:EP, random weights made on the device, world size 1), big enough that a 4k
prefill is real work next to a step's fixed cost; the tiny shipped K3 is not. A step's fixed
cost (eager launches: prefill steps run without CUDA graphs) is per layer, the prefill's work
per layer and width, so the narrower a rank (larger TP), the smaller the ratio: the shapes are
reported side by side, the first is the headline. Two engines
run it through ``TorchExecutor`` the way ``build_engine`` wires one: one with the prefix
cache, one without. For each of ``--repeats`` fresh prefixes P, one request at a time:

- uncached: P + suffix A and P + suffix B on the engine without the cache;
- cold: P + A on the cached engine (a miss: the KDA prefill writes the snapshots mid-chunk,
  so it runs the uncached steps; the cache's cost on a miss is the snapshot writes);
- cached: P + B on the cached engine, which restores the snapshot at len(P) and prefills B;
- uncached, cut at the hit: P + B on an engine without the cache whose token budget is the
  hit's position, so its first chunk ends where the hit resumes and the second computes what
  the hit computes. The hit against it isolates caching: bitwise equal when the restored
  snapshot (taken mid-chunk by the cold prefill of P + A) and P's blocks are exactly what a
  prefill of P alone leaves, i.e. when no kernel's per-token result depends on the chunk's
  length (a GEMM picking another tiling for another row count breaks that, not the cache).
  It against the one-chunk uncached run shows what cutting the prefill alone changes in bf16.

TTFT is the engine's own (a request's arrival to its first token, every step synchronised
by the sampler's copy to the host). Agreement: the cached run's generated tokens (greedy)
and first-token logits against the uncached run of the same prompt; the cold run against
its uncached twin shows what chunking alone changes in bf16, for scale.
"""
from __future__ import annotations

import argparse
import gc
import random
import statistics
import sys
import time
import traceback
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout

from rank_slice import (BenchError, _fill_random_, _int_at_least, bench_device, check_fits, commit_id,  # noqa: E402
                        model_bytes, rank_parallel, read_config_json, slice_config, slice_description,
                        write_json)

from k3_trtllm.model import K3Caches, K3ForCausalLM, prepare_weights_  # noqa: E402
from k3_trtllm.runtime.block_manager import resolve_prefix_interval  # noqa: E402
from k3_trtllm.runtime.engine import EngineConfig, LLMEngine  # noqa: E402
from k3_trtllm.runtime.executor import TorchExecutor  # noqa: E402
from k3_trtllm.runtime.sequence import SamplingParams  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_CONFIG = ROOT.parent / "shared" / "k3" / "config.json"
GOAL_SPEEDUP = 5.0  # issue 22: a 4k cached prefix's TTFT >= 5x faster than uncached
FIRST_ID = 3  # no pad/bos/eos in the prompts


def build_model(cfg, par, device: torch.device, seed: int) -> K3ForCausalLM:
    torch.manual_seed(seed)
    with torch.device("meta"):
        model = K3ForCausalLM(cfg, par)
    model = model.to_empty(device=device)
    with torch.no_grad():
        for name, buf in model.named_buffers():
            _fill_random_(name, buf)
    return prepare_weights_(model).eval()  # the kernels' layout, as a loaded model has it


class LogitsTap:
    """Keeps each step's logits (host copies) while ``on``, for the agreement checks; off
    while timing, so that the timed steps carry no extra copy."""

    def __init__(self, engine: LLMEngine) -> None:
        self.on, self.rows = False, []
        run = engine.runner.run

        def tapped(batch):
            logits = run(batch)
            if self.on and logits.shape[0]:
                self.rows.append(logits[0].float().cpu())
            return logits

        engine.runner.run = tapped


def make_engine(model, cfg, tp: int, args, device: torch.device, prefix_cache: bool,
                max_num_tokens: int | None = None):
    """An engine as ``build_engine`` makes one, over ``model``: pools for a few requests of
    ``--prefix-len + --suffix-len + --new-tokens`` tokens, and with the cache, snapshot rows
    for every interval of every prefix of the run; ``max_num_tokens`` (None: the flag's) cuts
    prefills into chunks of that many tokens."""
    per_seq = args.prefix_len + args.suffix_len + args.new_tokens
    max_slots = 2
    interval = resolve_prefix_interval(args.interval, args.block_size) if prefix_cache else 0
    prompts = 2 * (args.repeats + 1)  # every prompt the cached engine sees stays cached
    snapshots = prompts * -(-per_seq // interval) if prefix_cache else 0
    blocks_per_seq = -(-per_seq // args.block_size)
    num_blocks = (prompts + max_slots) * blocks_per_seq if prefix_cache else max_slots * blocks_per_seq
    check_fits(K3Caches.bytes_per_block(cfg, args.block_size) * num_blocks
               + K3Caches.bytes_per_slot(cfg, torch.bfloat16, tp) * (max_slots + snapshots), device,
               f"the cache pools ({num_blocks} blocks, {max_slots} + {snapshots} state rows)")
    caches = K3Caches.allocate(cfg, num_blocks, args.block_size, max_slots, model.dtype, device, tp_size=tp,
                               snapshot_slots=snapshots)
    config = EngineConfig(num_blocks=num_blocks, max_slots=max_slots, block_size=args.block_size,
                          max_batch_size=max_slots, max_num_tokens=max_num_tokens or args.max_num_tokens,
                          max_seq_len=per_seq,
                          prefix_cache=prefix_cache, prefix_cache_interval=interval,
                          snapshot_slots=snapshots if prefix_cache else None)
    engine = LLMEngine(TorchExecutor(model, caches, device), config)
    return engine, LogitsTap(engine)


def run_one(engine: LLMEngine, tap: LogitsTap, prompt: list[int], new_tokens: int, keep_logits: bool):
    """One request alone on ``engine``: (result, its first-token logits or None)."""
    tap.on, tap.rows = keep_logits, []
    result = engine.generate([prompt], SamplingParams(max_new_tokens=new_tokens, ignore_eos=True))[0]
    tap.on = False
    return result, (tap.rows[0] if keep_logits else None)


def compare(a, b, a_logits: torch.Tensor, b_logits: torch.Tensor) -> dict:
    """Generated tokens and first-token logits of run ``a`` against the reference run ``b``."""
    ta, tb = a.output_token_ids, b.output_token_ids
    first_diff = next((i for i, (x, y) in enumerate(zip(ta, tb)) if x != y), None)
    diff = (a_logits - b_logits).abs()
    ref_rms = b_logits.pow(2).mean().sqrt().item()
    top = torch.topk(b_logits, 2).values
    return {"tokens_identical": ta == tb, "first_differing_token": first_diff,
            "logits_max_abs_diff": diff.max().item(), "logits_rms_diff": diff.pow(2).mean().sqrt().item(),
            "logits_rms": ref_rms, "logits_bitwise_equal": torch.equal(a_logits, b_logits),
            "logits_cosine": torch.nn.functional.cosine_similarity(a_logits, b_logits, dim=0).item(),
            "first_token_equal": int(a_logits.argmax()) == int(b_logits.argmax()),
            "reference_top1_margin": (top[0] - top[1]).item()}


def ms(values) -> dict:
    data = [v * 1e3 for v in values]
    return {"median": statistics.median(data), "min": min(data), "max": max(data), "all": data}


def run_shape(data: dict, source: str, device: torch.device, args, tp: int, ep: int) -> dict:
    cfg = slice_config(data, args.layers, source)
    par = rank_parallel(cfg, tp, ep)
    weights = model_bytes(cfg, par)
    check_fits(weights, device, f"the slice's {weights / 2**30:.1f} GiB of weights")
    model = build_model(cfg, par, device, args.seed)
    off, off_tap = make_engine(model, cfg, tp, args, device, prefix_cache=False)
    on, on_tap = make_engine(model, cfg, tp, args, device, prefix_cache=True)
    interval = on.scheduler.prefix.interval
    cut_at = min(args.prefix_len // args.block_size * args.block_size,
                 args.prefix_len + args.suffix_len - 1) // interval * interval  # where P + B's hit resumes
    # the uncached twin of the hit: its first chunk ends at cut_at (none when P holds no snapshot)
    cut = make_engine(model, cfg, tp, args, device, prefix_cache=False, max_num_tokens=cut_at) if cut_at else None
    rng = random.Random(args.seed)
    vocab = model.lm_head.weight.shape[0]  # the rank's vocabulary shard: its embedding rows

    def ids(n):
        return [rng.randrange(FIRST_ID, vocab) for _ in range(n)]

    # Warm both engines on prompts of the measured shapes: a full prefill, a miss and a hit,
    # decode graphs, so that no first-call cost (kernel loads, allocator growth) is timed.
    warm_prefix = ids(args.prefix_len)
    for engine, tap in ((off, off_tap), (on, on_tap)) + ((cut,) if cut else ()):
        for _ in range(2):
            run_one(engine, tap, warm_prefix + ids(args.suffix_len), args.new_tokens, keep_logits=False)
    on.reset_stats()

    def deepest(shared: int) -> int:
        """Tokens a hit covers: the deepest snapshot within the shared full blocks, short of
        the prompt's last token (it always runs, for its logits)."""
        full = shared // args.block_size * args.block_size
        return min(full, args.prefix_len + args.suffix_len - 1) // interval * interval

    # P + B first shares P with P + A; run again, it shares all of itself (snapshots taken
    # past P by its first run)
    expected = [0, deepest(args.prefix_len), deepest(args.prefix_len + args.suffix_len)]
    assert expected[1] == cut_at
    rows = []
    for r in range(args.repeats):
        prefix, a, b = ids(args.prefix_len), ids(args.suffix_len), ids(args.suffix_len)
        unc_a, unc_a_logits = run_one(off, off_tap, prefix + a, args.new_tokens, keep_logits=True)
        cold, cold_logits = run_one(on, on_tap, prefix + a, args.new_tokens, keep_logits=True)
        unc_b, unc_b_logits = run_one(off, off_tap, prefix + b, args.new_tokens, keep_logits=True)
        hit, hit_logits = run_one(on, on_tap, prefix + b, args.new_tokens, keep_logits=True)
        # the same requests again without the logits tap: the timed runs
        t_unc = run_one(off, off_tap, prefix + b, args.new_tokens, keep_logits=False)[0]
        t_hit = run_one(on, on_tap, prefix + b, args.new_tokens, keep_logits=False)[0]
        versus_cut = {}
        if cut:
            unc_cut, unc_cut_logits = run_one(*cut, prefix + b, args.new_tokens, keep_logits=True)
            t_cut = run_one(*cut, prefix + b, args.new_tokens, keep_logits=False)[0]
            versus_cut = {"ttft_uncached_cut_s": t_cut.ttft_s,
                          "cached_vs_uncached_cut": compare(hit, unc_cut, hit_logits, unc_cut_logits),
                          "uncached_cut_vs_uncached": compare(unc_cut, unc_b, unc_cut_logits, unc_b_logits)}
        rows.append({
            "ttft_uncached_s": t_unc.ttft_s, "ttft_cached_s": t_hit.ttft_s, "ttft_cold_s": cold.ttft_s,
            "cached_tokens": [cold.cached_tokens, hit.cached_tokens, t_hit.cached_tokens],
            "cached_vs_uncached": compare(hit, unc_b, hit_logits, unc_b_logits),
            "cold_vs_uncached": compare(cold, unc_a, cold_logits, unc_a_logits),
            "timed_cached_tokens_identical": t_hit.output_token_ids == unc_b.output_token_ids,
            **versus_cut,
        })
        print(f"tp {tp} ep {ep} repeat {r}: TTFT uncached {t_unc.ttft_s * 1e3:.2f} ms, cached {t_hit.ttft_s * 1e3:.2f} ms "
              f"({hit.cached_tokens} cached tokens), cold {cold.ttft_s * 1e3:.2f} ms; tokens identical "
              f"{rows[-1]['cached_vs_uncached']['tokens_identical']}, logits cosine "
              f"{rows[-1]['cached_vs_uncached']['logits_cosine']:.6f}"
              + (f"; uncached cut at {cut_at}: TTFT {versus_cut['ttft_uncached_cut_s'] * 1e3:.2f} ms, hit logits "
                 f"bitwise equal {versus_cut['cached_vs_uncached_cut']['logits_bitwise_equal']}" if cut else ""),
              flush=True)
    unc, hit = ms(r["ttft_uncached_s"] for r in rows), ms(r["ttft_cached_s"] for r in rows)
    speedup = unc["median"] / hit["median"]
    agree = [r["cached_vs_uncached"] for r in rows]
    cached_ok = all(r["cached_tokens"] == expected for r in rows)
    ttft = {"uncached": unc, "cached": hit, "cold_with_cache": ms(r["ttft_cold_s"] for r in rows)}
    versus_cut = {}
    if cut:
        ttft["uncached_cut_at_hit"] = ms(r["ttft_uncached_cut_s"] for r in rows)
        hit_vs_cut = [r["cached_vs_uncached_cut"] for r in rows]
        cut_vs_whole = [r["uncached_cut_vs_uncached"] for r in rows]
        versus_cut = {
            "speedup_vs_uncached_cut": ttft["uncached_cut_at_hit"]["median"] / hit["median"],
            # caching alone: the hit against the uncached run computing the same chunks
            "cached_vs_uncached_cut": {
                "tokens_identical": sum(a["tokens_identical"] for a in hit_vs_cut), "of": len(hit_vs_cut),
                "logits_bitwise_equal": sum(a["logits_bitwise_equal"] for a in hit_vs_cut),
                "worst_logits_cosine": min(a["logits_cosine"] for a in hit_vs_cut),
                "worst_logits_max_abs_diff": max(a["logits_max_abs_diff"] for a in hit_vs_cut)},
            # chunking alone: the prefill cut at the hit against the one-chunk prefill, both uncached
            "uncached_cut_vs_uncached": {
                "tokens_identical": sum(a["tokens_identical"] for a in cut_vs_whole), "of": len(cut_vs_whole),
                "worst_logits_cosine": min(a["logits_cosine"] for a in cut_vs_whole),
                "worst_logits_max_abs_diff": max(a["logits_max_abs_diff"] for a in cut_vs_whole)},
        }
    return {
        "slice": slice_description(cfg, par, tp, ep),
        "weights_gib": weights / 2**30,
        "request": {"prefix_tokens": args.prefix_len, "suffix_tokens": args.suffix_len,
                    "new_tokens": args.new_tokens, "block_size": args.block_size, "interval": interval,
                    "max_num_tokens": args.max_num_tokens, "expected_cached_tokens": expected,
                    "uncached_cut_at": cut_at or None},
        "ttft_ms": ttft,
        "speedup": speedup, "goal_met": speedup >= GOAL_SPEEDUP, **versus_cut,
        "cached_tokens_as_expected": cached_ok,
        "agreement": {
            "tokens_identical": sum(a["tokens_identical"] for a in agree), "of": len(agree),
            "first_token_equal": sum(a["first_token_equal"] for a in agree),
            "worst_logits_cosine": min(a["logits_cosine"] for a in agree),
            "worst_logits_max_abs_diff": max(a["logits_max_abs_diff"] for a in agree),
            "cold_chunking_worst_logits_max_abs_diff": max(r["cold_vs_uncached"]["logits_max_abs_diff"]
                                                           for r in rows),
        },
        "repeats": rows,
        "prefix_cache": on.summary()["prefix_cache"],
    }


def meta(device: torch.device, args, source: str) -> dict:
    return {"commit": f"{commit_id()} + working tree",
            "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
            "torch": torch.__version__, "cuda": torch.version.cuda, "config": source,
            "date_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "args": {k: v for k, v in vars(args).items() if k != "out"}, "command": " ".join(sys.argv)}


def _shapes(text: str) -> list[tuple[int, int]]:
    try:
        shapes = [tuple(int(v) for v in item.split(":")) for item in text.split(",") if item.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: expected TP:EP[,TP:EP...]") from None
    if not shapes or any(len(s) != 2 or min(s) < 1 for s in shapes):
        raise argparse.ArgumentTypeError(f"{text!r}: expected TP:EP pairs of positive integers")
    return shapes


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one line, no usage block
        self.exit(2, f"prefix_cache_ttft.py: {message}\n")


def parse_args(argv=None):
    positive, non_negative = _int_at_least(1), _int_at_least(0)
    p = _Parser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default=str(DEFAULT_CONFIG), help="K3 config.json (default ../shared/k3/config.json)")
    p.add_argument("--shapes", type=_shapes, default=[(2, 2), (4, 4), (8, 8)],
                   help="TP:EP[,TP:EP...]: each a rank of that TP/EP layout, measured in turn (default 2:2,4:4,8:8)")
    p.add_argument("--layers", type=positive, default=8, help="the config's first N layers")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--prefix-len", type=positive, default=4096, help="tokens of the shared (cached) prefix")
    p.add_argument("--suffix-len", type=positive, default=32, help="tokens after it, different per request")
    p.add_argument("--new-tokens", type=positive, default=16, help="greedy tokens generated per request")
    p.add_argument("--block-size", type=positive, default=64)
    p.add_argument("--interval", type=non_negative, default=0,
                   help="tokens between KDA snapshots (0: the engine's default)")
    p.add_argument("--max-num-tokens", type=positive, default=8192,
                   help="tokens per step: the uncached prompt prefills in one step")
    p.add_argument("--repeats", type=positive, default=3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", help="JSON report (written whole or not at all)")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        device = bench_device(args.device)
        try:
            resolve_prefix_interval(args.interval, args.block_size)
        except ValueError as e:
            raise BenchError(str(e).replace("--prefix-cache-interval", "--interval")) from None
        path = Path(args.config)
        data = read_config_json(path)
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            for tp, ep in args.shapes:  # every shape's flags checked before the first one runs
                rank_parallel(slice_config(data, args.layers, str(path)), tp, ep)
            report = {"meta": meta(device, args, str(path)), "goal_speedup": GOAL_SPEEDUP, "runs": []}
            for tp, ep in args.shapes:
                try:
                    report["runs"].append(run_shape(data, str(path), device, args, tp, ep))
                except (RuntimeError, ValueError) as e:  # out of memory, a kernel's refusal: the next shape runs
                    where = traceback.format_exc().strip().splitlines()[-12:]  # which phase and call failed
                    print(f"tp {tp} ep {ep}: failed: {type(e).__name__}: {e}", *where, sep="\n", file=sys.stderr)
                    report["runs"].append({"slice": {"tp": tp, "ep": ep}, "error": f"{type(e).__name__}: {e}",
                                           "traceback": where})
                gc.collect()  # the slice and its engines go before the next one is made
                if device.type == "cuda":
                    torch.cuda.empty_cache()
                if args.out:  # what is measured survives a later shape that runs out of time
                    write_json(args.out, report)
            head = report["runs"][0]
            report["speedup"], report["goal_met"] = head.get("speedup"), head.get("goal_met", False)
        # a kernel falling back to the reference op would make every figure meaningless: say so
        report["warnings"] = sorted({f"{w.category.__name__}: {w.message}" for w in seen})
        for w in report["warnings"]:
            print("warning:", w, file=sys.stderr)
    except BenchError as e:
        print(f"prefix_cache_ttft.py: {e}", file=sys.stderr)
        return 2
    for run in report["runs"]:
        if "error" in run:
            continue
        t, shape = run["ttft_ms"], run["slice"]
        print(f"tp {shape['tp']} ep {shape['ep']}: TTFT median uncached {t['uncached']['median']:.2f} ms, cached "
              f"{t['cached']['median']:.2f} ms ({run['speedup']:.1f}x, goal {GOAL_SPEEDUP:.0f}x), cold with cache "
              f"{t['cold_with_cache']['median']:.2f} ms; tokens identical {run['agreement']['tokens_identical']}/"
              f"{run['agreement']['of']}, cached tokens as expected: {run['cached_tokens_as_expected']}")
        if "uncached_cut_at_hit" in t:
            vs = run["cached_vs_uncached_cut"]
            print(f"  vs uncached cut at the hit ({run['request']['uncached_cut_at']}): TTFT "
                  f"{t['uncached_cut_at_hit']['median']:.2f} ms ({run['speedup_vs_uncached_cut']:.1f}x); hit tokens "
                  f"identical {vs['tokens_identical']}/{vs['of']}, logits bitwise equal {vs['logits_bitwise_equal']}/"
                  f"{vs['of']}, worst cosine {vs['worst_logits_cosine']:.6f}; cut vs one chunk, worst cosine "
                  f"{run['uncached_cut_vs_uncached']['worst_logits_cosine']:.6f}")
    if args.out:
        write_json(args.out, report)
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
