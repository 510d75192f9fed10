"""The shipped tiny K3 on the GPU: ``load_model(device="cuda")`` installs the CUDA kernels as the
k3 ops' implementations, the model's steps launch them (MLA, KDA and MoE kernels seen in the
profiler's CUDA kernel records), and its logits match the same bf16 checkpoint run by the fp32
reference ops on the CPU.

Skipped without CUDA or without the kernel library (build_scripts/build_kernels.sh or
K3_KERNELS_LIB).

Tolerance: relative Frobenius error of the logits <= 5e-2. Both sides hold bf16 activations
between ops; inside the ops the kernels differ from the reference by their own bounds (MLA
<= 1e-2, KDA prefill <= 1e-2, MoE <= 2e-3, tests/gpu/test_*_cuda.py), and a bf16 rounding
flipped early reaches the logits through ten layers: a few 1e-3 to 1e-2 in total. A kernel
that computes the wrong thing (wrong head, slot, expert or state hand-off) gives O(1).
"""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from k3_trtllm.kernels import library_path

ROOT = Path(__file__).resolve().parents[2]
TINY = ROOT / "examples" / "tiny-k3"
BS = 16
TOL = 5e-2

pytestmark = [
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
    pytest.mark.skipif(not library_path().exists(), reason=f"kernel library {library_path()} not built"),
]


def _prompt(seed: int, n: int) -> list[int]:
    return torch.randint(3, 1024, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _prefill_then_decodes(model, device: str) -> torch.Tensor:
    """Three sequences (70, 9 and 1 tokens: a chunk boundary, a short one, a single token)
    prefilled in one step, then three decode steps of all three."""
    from k3_trtllm.model import build_step
    prompts = [_prompt(1, 73), _prompt(2, 12), _prompt(3, 4)]
    lengths = [70, 9, 1]
    tables = [[0, 1, 2, 3, 4], [5], [6]]
    caches = model.allocate_caches(8, BS, 3)
    seqs = [(p[:n], 0, i, t) for i, (p, n, t) in enumerate(zip(prompts, lengths, tables))]
    rows = [model(build_step(seqs, BS, logits_all=True).to(device), caches)]
    for d in range(3):
        seqs = [([p[n + d]], n + d, i, t) for i, (p, n, t) in enumerate(zip(prompts, lengths, tables))]
        rows.append(model(build_step(seqs, BS).to(device), caches))
    return torch.cat(rows).float().cpu()


def test_tiny_k3_runs_the_cuda_kernels_and_matches_the_cpu_reference():
    from k3_trtllm.model import load_model
    ref = _prefill_then_decodes(load_model(TINY, dtype=torch.bfloat16, device="cpu"), "cpu")
    model = load_model(TINY, dtype=torch.bfloat16, device="cuda")
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        got = _prefill_then_decodes(model, "cuda")
        torch.cuda.synchronize()
    names = {e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA}
    for family in ("k3::kda::", "k3::mla::", "k3::moe::"):
        assert any(family in n for n in names), f"no {family} kernel ran; CUDA kernels seen: {sorted(names)[:20]}"
    assert torch.isfinite(got).all()
    err = float((got - ref).norm() / ref.norm())
    print(f"tiny K3 on CUDA vs CPU reference: logits rel err {err:.2e}, "
          f"argmax agreement {(got.argmax(-1) == ref.argmax(-1)).float().mean():.3f}")
    assert err < TOL
