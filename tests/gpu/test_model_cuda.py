"""The shipped tiny K3 on the GPU: ``load_model(device="cuda")`` installs the CUDA kernels as the
k3 ops' implementations, the model's steps launch them (MLA, KDA and MoE kernels seen in the
profiler's CUDA kernel records), and every k3 op call of a prefill step and three decode steps
(caches handed from step to step by the kernels themselves) agrees with the fp32 reference op
run on CPU copies of the same inputs: outputs and updated caches.

Skipped without CUDA or without the kernel library (build_scripts/build_kernels.sh or
K3_KERNELS_LIB).

Tolerance: relative Frobenius error <= 1e-2 per op call, the loosest single-op bound of
tests/gpu/test_*_cuda.py (MLA, KDA prefill with bf16 operands); a wrong head, slot, expert or
state hand-off gives O(1). The logits are not compared end to end: this random tiny model is
chaotic. In the CPU reference alone, Gaussian noise of 1e-3 of each op output's RMS gives
logits 0.46 apart (relative Frobenius, argmax agreement 0.56), so no end-to-end bound would
separate a correct kernel from a wrong one; the H200 run gave 0.35 with every op within 4.4e-3.
"""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from k3_trtllm.ops.cuda_library import library_path
from k3_trtllm.ops import registry

ROOT = Path(__file__).resolve().parents[2]
TINY = ROOT / "examples" / "tiny-k3"
BS = 16
OP_TOL = 1e-2  # see the module docstring

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
    rows = [model(build_step(seqs, BS, logits_all=True).to(device), caches, decode=False)]
    for d in range(3):
        seqs = [([p[n + d]], n + d, i, t) for i, (p, n, t) in enumerate(zip(prompts, lengths, tables))]
        rows.append(model(build_step(seqs, BS).to(device), caches, decode=True))
    return torch.cat(rows).float().cpu()


def _rel(got: torch.Tensor, ref: torch.Tensor) -> float:
    return float((got.float().cpu() - ref.float()).norm() / ref.float().norm().clamp_min(1e-30))


class _OpComparer:
    """Runs every k3 op call of the CUDA model a second time through the reference op on CPU
    copies of its inputs and records the largest relative error per op (outputs and updated
    caches), so a failing model test names the op that diverged first."""

    def __init__(self):
        self.worst: dict[str, float] = {}
        self.first_bad: str | None = None

    def __call__(self, contract, *args):
        cpu_args = [a.detach().cpu().clone() if isinstance(a, torch.Tensor) else a for a in args]
        cpu_out = registry.call(contract, *cpu_args)
        out = registry.call(contract, *args)
        pairs = list(zip(out if isinstance(out, tuple) else (out,),
                         cpu_out if isinstance(cpu_out, tuple) else (cpu_out,)))
        pairs += [(args[i], cpu_args[i]) for i, t in enumerate(contract.inputs) if t.mutated]
        err = max((_rel(g, r) for g, r in pairs if r.is_floating_point() and r.numel()), default=0.0)
        self.worst[contract.name] = max(self.worst.get(contract.name, 0.0), err)
        if err > OP_TOL and self.first_bad is None:
            self.first_bad = f"{contract.name} (rel err {err:.2e})"
        return out


def test_tiny_k3_runs_the_cuda_kernels_and_every_op_matches_the_reference(monkeypatch):
    from k3_trtllm.model import layers, load_model
    comparer = _OpComparer()
    monkeypatch.setattr(layers, "call", comparer)
    model = load_model(TINY, dtype=torch.bfloat16, device="cuda")
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        logits = _prefill_then_decodes(model, "cuda")
        torch.cuda.synchronize()
    print("worst rel err per op, CUDA vs reference on the same inputs:",
          {k: f"{v:.1e}" for k, v in comparer.worst.items()})
    assert set(comparer.worst) == {"kda_prefill", "kda_decode", "mla_prefill", "mla_decode", "situ_moe_mxfp4"}
    assert comparer.first_bad is None, f"first op beyond {OP_TOL}: {comparer.first_bad}"
    names = {e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA}
    for family in ("k3::kda::", "k3::mla::", "k3::moe::"):
        assert any(family in n for n in names), f"no {family} kernel ran; CUDA kernels seen: {sorted(names)[:20]}"
    assert torch.isfinite(logits).all()
