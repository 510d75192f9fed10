"""Cost of the batch-invariant mode's torch part (k3_trtllm/ops/batch_invariant.py) at one
K3 TP8 rank's dense shapes: a bf16 GEMM x[T, 7168] · W[N, 7168]ᵀ for N = 7168 (hidden), 2112
(MLA fused_a: q_lora 1536 + kv_lora 512 + rope 64) and 20480 (vocab / 8, fp32 like the LM head
is run), and RMSNorm over 7168, for T = 1, 8, 64, 512, 4096: default vs mode, same process.

    python3 bench/batch_invariant_cost.py --out DIR      (writes DIR/batch_invariant_cost.json)

Times: CUDA events, median of 20 calls after 3 warm-ups (eager: the mode's per-chunk launches
and copies count, as they would in an eager step).
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from k3_trtllm.ops.batch_invariant import set_batch_invariant  # noqa: E402
from k3_trtllm.ops.common import rms_norm  # noqa: E402
from cuda_timing import time_ms  # noqa: E402  (bench/, the script's folder, is on sys.path)

TOKENS = (1, 8, 64, 512, 4096)
GEMMS = {"hidden_7168": (7168, torch.bfloat16), "mla_fused_a_2112": (2112, torch.bfloat16),
         "lm_head_20480_fp32": (20480, torch.float32)}
D = 7168


def measure() -> dict:
    g = torch.Generator(device="cuda").manual_seed(0)
    out = {}
    for name, (n, dtype) in GEMMS.items():
        w = (torch.randn(n, D, generator=g, device="cuda") * D ** -0.5).to(dtype)
        for T in TOKENS:
            x = torch.randn(T, D, generator=g, device="cuda").to(dtype)
            out[f"{name}_T{T}"] = time_ms(lambda: torch.nn.functional.linear(x, w), 20, warmup=3)
    norm_w = torch.randn(D, generator=g, device="cuda").bfloat16()
    for T in TOKENS:
        x = torch.randn(T, D, generator=g, device="cuda").bfloat16()
        out[f"rms_norm_{D}_T{T}"] = time_ms(lambda: rms_norm(x, norm_w, 1e-6), 20, warmup=3)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path("."))
    args = parser.parse_args()
    default = measure()
    set_batch_invariant(True)
    try:
        invariant = measure()
    finally:
        set_batch_invariant(False)
    result = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
              "cases": {k: {"default_ms": default[k], "batch_invariant_ms": invariant[k],
                            "ratio": invariant[k] / default[k]} for k in default}}
    for k, v in result["cases"].items():
        print(f"{k}: default {v['default_ms']:.4f} ms, batch-invariant {v['batch_invariant_ms']:.4f} ms, "
              f"x{v['ratio']:.2f}")
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "batch_invariant_cost.json").write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
