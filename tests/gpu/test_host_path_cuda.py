"""The host side of an eager step on the H200 (issue 20's host time and launches): a host step reaches
the device in one copy, cut into 16-byte aligned views equal to the field-by-field copies, and steps
moved back to back keep their values; a step's no-snapshot tensors are made once per batch size
(no launch after the first) and a decode graph captured later reads them; the norm wrappers' quick
operand checks send to the reference exactly the calls the named checks reject.

Skipped without CUDA or without the kernel library (build_scripts/build_kernels.sh)."""
from __future__ import annotations

from dataclasses import fields
from pathlib import Path

import pytest
import torch

from k3_trtllm.ops.cuda_library import library_path

ROOT = Path(__file__).resolve().parents[2]
TINY = ROOT / "examples" / "tiny-k3"

pytestmark = [
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
    pytest.mark.skipif(not library_path().exists(), reason=f"kernel library {library_path()} not built"),
]


def _kernels(fn) -> list[str]:
    fn()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]


def test_a_host_step_reaches_the_device_in_one_aligned_copy():
    from k3_trtllm.model import StepInputs, build_step
    step = build_step([([5, 6, 7], 0, 1, [2]), ([8], 9, 0, [0, 1, 3])], 16, snapshots=[[(3, 1)], []])
    moved = step.to("cuda")
    for f in fields(StepInputs):
        t = getattr(moved, f.name)
        assert t.is_cuda and t.dtype == torch.int32 and t.data_ptr() % 16 == 0, f.name
        assert torch.equal(t.cpu(), getattr(step, f.name)), f.name
    copies = [k for k in _kernels(lambda: step.to("cuda")) if "Memcpy HtoD" in k]
    assert len(copies) == 1, copies


def test_steps_moved_back_to_back_keep_their_own_values():
    """The pinned staging buffer is reused: a step packed while the previous step's copy may still
    be in flight (a busy stream ahead of both) must wait for it, not overwrite what it reads."""
    from k3_trtllm.model import build_step
    busy = torch.randn(4096, 4096, device="cuda")
    steps = [build_step([([7 * i + k for k in range(5)], 3 * i, i % 4, [i, i + 1])], 16) for i in range(6)]
    for _ in range(3):
        busy @ busy  # the copies queue behind these
    moved = [s.to("cuda") for s in steps]
    for s, m in zip(steps, moved):
        assert torch.equal(m.input_ids.cpu(), s.input_ids) and torch.equal(m.block_tables.cpu(), s.block_tables)


def test_no_snapshot_tensors_are_made_once_and_a_later_capture_reads_them():
    """A CUDA step's no-snapshot pair is made by the first step of a batch size (two fills) and then
    reused with no launch; a decode graph captured after the eager warm-up reads that pair (its
    memory is the process's, not the graph pool's) and replays."""
    from k3_trtllm.model import build_step, load_model
    from k3_trtllm.model import step as step_module
    from k3_trtllm.model.step import with_snapshot_tensors
    from k3_trtllm.runtime.executor import TorchExecutor
    seqs = 7  # a batch size no other test of the session is likely to have made the pair of
    new_step = lambda: build_step([([5 + i], 20, i, [i]) for i in range(seqs)], 64).to("cuda")  # noqa: E731
    first = with_snapshot_tensors(new_step())
    assert first.snapshot_offsets.tolist() == [[-1]] * seqs and first.snapshot_rows.tolist() == [[0]] * seqs
    assert (first.snapshot_offsets.device, seqs) in step_module._NO_SNAPSHOTS
    again = new_step()
    assert _kernels(lambda: with_snapshot_tensors(again)) == []
    assert with_snapshot_tensors(again).snapshot_offsets is first.snapshot_offsets
    model = load_model(TINY, dtype=torch.bfloat16, device="cuda")
    caches = model.allocate_caches(8, 16, 4)
    step = build_step([([5], 20, 0, [2, 3])], 16)
    graphs = TorchExecutor(model, caches, "cuda", cuda_graphs=True)
    for _ in range(3):  # eager warm-up and capture, then replays
        logits = graphs.execute(step, True)
    assert graphs.graph_replays == 2 and torch.isfinite(logits).all()


@pytest.mark.parametrize("case", ["ok", "fp32_weight", "strided_last", "fp32_x", "short_weight", "weight_on_cpu",
                                  "odd_dim", "3d_rows"])
def test_the_quick_norm_checks_agree_with_the_named_ones(case, monkeypatch):
    """Each variant either runs the kernel (no warning, the reference's values to one bf16 ulp) or
    falls back with the named reason, as before the quick checks."""
    from k3_trtllm.ops import common, cuda_library
    from k3_trtllm.ops.norm import cuda
    monkeypatch.setattr(cuda_library, "_warned", set())
    g = torch.Generator(device="cuda").manual_seed(3)
    x = torch.randn(4, 256, device="cuda", generator=g).bfloat16()
    w = (1 + 0.1 * torch.randn(256, device="cuda", generator=g)).bfloat16()
    falls = {"strided_last": "strided last dim", "fp32_x": "dtype float32", "short_weight": "weight of length 128",
             "weight_on_cpu": "norm_weight|weight on cpu", "odd_dim": "odd last dim", "3d_rows": "they take \\[T, d\\]"}
    if case == "fp32_weight":
        w = w.float()
    elif case == "strided_last":
        x = torch.randn(4, 512, device="cuda", generator=g).bfloat16()[:, ::2]
    elif case == "fp32_x":
        x = x.float()
    elif case == "short_weight":
        w = w[:128]
    elif case == "weight_on_cpu":
        w = w.cpu()
    elif case == "odd_dim":
        x, w = x[:, :255].contiguous(), w[:255].contiguous()
    elif case == "3d_rows":
        x = x.view(4, 2, 128)
        w = w[:128].contiguous()
    if case in falls:
        with pytest.warns(cuda_library.KernelFallbackWarning, match=falls[case]):
            try:
                cuda.rms_norm(x, w, 1e-5)
            except RuntimeError:  # the reference refuses operands on two devices, or a weight of the wrong length
                assert case in ("weight_on_cpu", "short_weight")
    else:
        import warnings
        with warnings.catch_warnings():
            warnings.simplefilter("error", cuda_library.KernelFallbackWarning)
            got = cuda.rms_norm(x, w, 1e-5)
        want = common.rms_norm(x.double(), w.double(), 1e-5)
        assert torch.allclose(got.double(), want, rtol=2 ** -7, atol=1e-6)

