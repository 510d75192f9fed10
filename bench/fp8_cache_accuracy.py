#!/usr/bin/env python3
"""Accuracy of the fp8 latent cache (``--kv-cache-dtype fp8``, issue 21) against the
activation-dtype cache on the tiny models, on the CPU (the reference ops: the numerics the
kernels are checked against).

Per model, one fixed batch of prompts runs through four configurations: fp32 activations
with the fp32 cache ("fp32", the reference) and with the fp8 cache ("fp32+fp8"); bf16
activations with the bf16 cache ("bf16", production today) and with the fp8 cache
("bf16+fp8"). Two measurements:

- logit error, teacher-forced: every configuration is fed the same tokens (the prompt, then
  the reference's greedy continuation), prefill then one-token decode steps (the decode op
  forms), so the logits at each of the N generated positions are compared on identical
  contexts. Errors are |l - l_ref| over the vocabulary, relative to the logit scale (the
  reference logits' standard deviation at that position): the maximum over positions and
  vocabulary, the 99th percentile and the mean, and how often the two argmaxes agree.
  Pairs: fp32+fp8 vs fp32 (the cache's error alone), bf16+fp8 vs bf16 (the cache's error
  where it runs), and bf16 vs fp32 (bf16 activations' own error, for scale);
- greedy agreement, free-running: each configuration generates N tokens greedily on its
  own; per prompt the first position where its tokens leave the other's (None: never) and
  the share of the N positions that match.

    python bench/fp8_cache_accuracy.py [--new-tokens 24] [--models tiny-k3,kernel-shapes]
                                       [--out bench/results/fp8_cache_accuracy.json]

Models: examples/tiny-k3 (MXFP4 experts; R 64, so one scale per 64-channel row) and the
synthesised preset "kernel-shapes" (K3's MLA dims: R 512, Dr 64, four scale groups of 128, the
656-byte row); other presets on request. Random weights: the numbers measure the cache's
numerics through a whole model, not a trained model's quality."""
from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from k3_trtllm.checkpoint.synth import PRESETS, synth_checkpoint  # noqa: E402
from rank_slice import commit_id  # noqa: E402  (bench/ is on sys.path when run as a script)
from k3_trtllm.model import build_step, load_model  # noqa: E402

CONFIGS = {"fp32": (torch.float32, "auto"), "fp32+fp8": (torch.float32, "fp8"),
           "bf16": (torch.bfloat16, "auto"), "bf16+fp8": (torch.bfloat16, "fp8")}
PAIRS = (("fp32+fp8", "fp32"), ("bf16+fp8", "bf16"), ("bf16", "fp32"))
BLOCK_SIZE = 16


PROMPT_LENS = (8, 33, 64, 128)


def prompts(vocab: int, seed: int = 0) -> list[list[int]]:
    """Prompts of PROMPT_LENS tokens of text ids (3 .. vocab-1), fixed by the seed."""
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(n)] for n in PROMPT_LENS]


class Runner:
    """One model in one configuration: a batch of sequences stepped together (one prefill
    step of every prompt, then one-token decode steps), each in its own blocks and state slot."""

    def __init__(self, model_dir: Path, dtype: torch.dtype, kv_cache_dtype: str, max_len: int, batch: int):
        self.model = load_model(model_dir, dtype=dtype)
        self.blocks = -(-max_len // BLOCK_SIZE)
        self.kv, self.batch = kv_cache_dtype, batch

    @torch.inference_mode()
    def run(self, prompts: list[list[int]], new_tokens: int, forced: list[list[int]] | None = None):
        """(fp32 logits [batch, new_tokens, vocab], generated tokens): greedy, or fed ``forced``."""
        caches = self.model.allocate_caches(self.blocks * len(prompts), BLOCK_SIZE, len(prompts), self.kv)
        tables = [list(range(i * self.blocks, (i + 1) * self.blocks)) for i in range(len(prompts))]
        seqs = [(p, 0, i, tables[i]) for i, p in enumerate(prompts)]
        context = [0] * len(prompts)
        logits, tokens = [], [[] for _ in prompts]
        for t in range(new_tokens):
            step = build_step(seqs, BLOCK_SIZE)
            out = self.model(step, caches, decode=t > 0).float()
            logits.append(out)
            picked = out.argmax(-1).tolist()
            nxt = [f[t] for f in forced] if forced is not None else picked
            for i, tok in enumerate(picked):
                tokens[i].append(tok)
            context = [c + len(s[0]) for c, s in zip(context, seqs)]
            seqs = [([nxt[i]], context[i], i, tables[i]) for i in range(len(prompts))]
        return torch.stack(logits, 1), tokens


def logit_error(test: torch.Tensor, ref: torch.Tensor) -> dict:
    scale = ref.std(-1, keepdim=True)  # per sequence and position
    rel = (test - ref).abs() / scale
    return {"max_abs_err_over_logit_std": rel.max().item(),
            "p99_abs_err_over_logit_std": rel.flatten().kthvalue(max(1, int(0.99 * rel.numel()))).values.item(),
            "mean_abs_err_over_logit_std": rel.mean().item(),
            "mean_logit_std": scale.mean().item(),
            "teacher_forced_argmax_agreement": (test.argmax(-1) == ref.argmax(-1)).float().mean().item()}


def agreement(test: list[list[int]], ref: list[list[int]]) -> dict:
    first = [next((i for i, (a, b) in enumerate(zip(x, y)) if a != b), None) for x, y in zip(test, ref)]
    n = len(ref[0])
    return {"first_divergence": first,
            "identical_sequences": sum(f is None for f in first),
            "matching_positions": sum(a == b for x, y in zip(test, ref) for a, b in zip(x, y)) / (n * len(ref)),
            "tokens_before_first_divergence": sum(n if f is None else f for f in first) / (n * len(ref))}


def measure(name: str, model_dir: Path, new_tokens: int, log) -> dict:
    from k3_trtllm.config import load_config

    cfg = load_config(model_dir)
    batch = prompts(cfg.vocab_size)
    max_len = max(map(len, batch)) + new_tokens
    runners = {c: Runner(model_dir, dtype, kv, max_len, len(batch)) for c, (dtype, kv) in CONFIGS.items()}
    t0 = time.time()
    ref_logits, ref_tokens = runners["fp32"].run(batch, new_tokens)
    forced = {"fp32": ref_logits}
    free = {"fp32": ref_tokens}
    for c in ("fp32+fp8", "bf16", "bf16+fp8"):
        forced[c] = runners[c].run(batch, new_tokens, forced=ref_tokens)[0]
        free[c] = runners[c].run(batch, new_tokens)[1]
        log(f"{name}: {c} done ({time.time() - t0:.0f} s)")
    m = cfg.mla
    return {
        "model": name, "kv_lora_rank": m.kv_lora_rank, "qk_rope_head_dim": m.qk_rope_head_dim,
        "mla_layers": len(cfg.mla_layer_indices), "num_hidden_layers": cfg.num_hidden_layers,
        "prompt_lens": [len(p) for p in batch], "new_tokens": new_tokens,
        "pairs": {f"{a} vs {b}": {**logit_error(forced[a], forced[b]), **agreement(free[a], free[b])}
                  for a, b in PAIRS},
    }


def meta() -> dict:
    return {"commit": f"{commit_id()} + working tree", "device": "cpu", "torch": torch.__version__,
            "date_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "command": " ".join(sys.argv)}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--new-tokens", type=int, default=24, help="generated tokens per prompt")
    parser.add_argument("--models", default="tiny-k3,kernel-shapes",
                        help="comma-separated: tiny-k3 (examples/tiny-k3) and synthesised presets (tiny, "
                             "tiny-mxfp4, kernel-shapes)")
    parser.add_argument("--out", type=Path, default=ROOT / "bench/results/fp8_cache_accuracy.json")
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    args = parser.parse_args(argv)
    if args.new_tokens < 1:
        parser.error("--new-tokens must be >= 1")
    torch.set_num_threads(args.threads)
    names = [n for n in args.models.split(",") if n]
    unknown = sorted(set(names) - {"tiny-k3", *PRESETS})
    if unknown or not names:
        parser.error(f"--models {args.models}: unknown {unknown}; expected tiny-k3 or one of {', '.join(PRESETS)}")
    log = lambda msg: print(msg, file=sys.stderr)  # noqa: E731
    results = []
    with tempfile.TemporaryDirectory(prefix="k3-fp8-acc-") as tmp:
        models = [("examples/tiny-k3", ROOT / "examples/tiny-k3") if n == "tiny-k3" else
                  (f"synth {n} (seed 0)", synth_checkpoint(Path(tmp) / n, n, 0)) for n in names]
        for name, path in models:
            results.append(measure(name, path, args.new_tokens, log))
    report = {**meta(), "block_size": BLOCK_SIZE, "configs": {c: {"activations": str(d).removeprefix("torch."),
                                                                  "kv_cache_dtype": kv}
                                                              for c, (d, kv) in CONFIGS.items()},
              "models": results}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1) + "\n")
    for r in results:
        for pair, v in r["pairs"].items():
            log(f"{r['model']:32s} {pair:20s} max {v['max_abs_err_over_logit_std']:.4f} p99 "
                f"{v['p99_abs_err_over_logit_std']:.4f} mean "
                f"{v['mean_abs_err_over_logit_std']:.5f} (x logit std)  greedy match "
                f"{v['matching_positions']:.3f}  first divergences {v['first_divergence']}")
    log(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
