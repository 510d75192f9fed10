"""CUDA KDA kernels (plugins/c_api/kda.cu) against the fp32 reference ops on the CPU.

The oracle is the reference ``k3::kda_decode`` run on CPU copies: the exact token
recurrence of §4.5.6 in fp32 (it is itself checked against the chunked form in
tests/test_kda_ops.py). Both CUDA ops (chunked prefill, token-recurrent decode) are
compared with it on the output, every touched conv-state row (exact: raw inputs are
copied) and every touched recurrent-state row; untouched slots must stay bit-identical.

Tolerances (relative Frobenius error):
- decode kernel: everything in fp32 like the reference; the only rounding that differs
  is the bf16 rounding of the conv output and of the core output when the fp32 values
  differ in the last bits (a 1-ulp bf16 flip is 4e-3 on that element and rare), so
  out < 2e-3 and state < 1e-4.
- prefill kernel: the chunk products run on tensor cores with bf16 operands and fp32
  accumulation (the precision of FLA / vLLM's chunk kernels, spec §7.6): every operand
  (decay-scaled q/k, Linv, W, U, U', A_qk and the state copy used as an operand) is
  rounded to 8 bits of mantissa (2^-9 relative), the carried state stays fp32. A CPU
  emulation of exactly these roundings gives ~4e-3 on the output and 2-3e-3 on the
  state at these shapes, plus the bf16 output rounding and fast-math SiLU (an
  occasional 1-ulp bf16 flip of a conv output): out < 1e-2, state < 5e-3.
Skips without CUDA or without build/libk3_kernels.so.
"""
from __future__ import annotations

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA device", allow_module_level=True)

import k3_trtllm.ops.kda  # noqa: F401,E402  (registers the reference ops)
from k3_trtllm.ops import cuda_library as kernels  # noqa: E402

if not kernels.library_path().exists():
    pytest.skip("build/libk3_kernels.so not built", allow_module_level=True)

from k3_trtllm.ops.kda import cuda as kda_kernels  # noqa: F401,E402  (installs the CUDA kernels)

CONV_WIDTH = 4
PREFILL_TOL = (1e-2, 5e-3)  # (out, state), see the module docstring
DECODE_TOL = (2e-3, 1e-4)


def rel_err(x: torch.Tensor, ref: torch.Tensor) -> float:
    x, ref = x.double().cpu(), ref.double().cpu()
    assert torch.isfinite(x).all(), "non-finite values"
    return float((x - ref).norm() / ref.norm().clamp_min(1e-30))


def make_case(lengths, num_heads, head_dim, lower_bound, initial, seed):
    """Random inputs for a varlen batch; slots are a shuffled subset of a larger pool."""
    g = torch.Generator().manual_seed(seed)
    H, K, W = num_heads, head_dim, CONV_WIDTH
    P, B, T = H * K, len(lengths), sum(lengths)
    pool = B + 3

    def randn(*shape, s=1.0):
        return torch.randn(*shape, generator=g) * s

    slots = torch.randperm(pool, generator=g)[:B].to(torch.int32)
    cu = torch.tensor([0] + list(torch.tensor(lengths).cumsum(0)), dtype=torch.int32)
    return dict(
        qkv=randn(T, 3 * P).bfloat16(),
        gate=randn(T, P, s=2.0).bfloat16(),
        beta=randn(T, H, s=2.0).bfloat16(),
        conv_weight=randn(3 * P, W, s=0.6),
        A_log=randn(H, s=0.5),
        dt_bias=randn(P, s=0.5),
        cu_seqlens=cu,
        state_slots=slots,
        has_initial_state=torch.tensor(initial, dtype=torch.int32),
        conv_state=randn(pool, 3 * P, W - 1).bfloat16(),
        recurrent_state=randn(pool, H, K, K, s=0.3),
        attrs=(H, K, float(lower_bound)),
    )


ARG_ORDER = ("qkv", "gate", "beta", "conv_weight", "A_log", "dt_bias", "cu_seqlens", "state_slots",
             "has_initial_state", "conv_state", "recurrent_state")


def run(op, case, device):
    tensors = {k: case[k].clone().to(device) for k in ARG_ORDER}
    out = op(*(tensors[k] for k in ARG_ORDER), *case["attrs"])
    return out.cpu(), tensors["conv_state"].cpu(), tensors["recurrent_state"].cpu()


def check_against_reference(case, op, tol, label):
    ref_out, ref_conv, ref_state = run(torch.ops.k3.kda_decode, case, "cpu")
    out, conv, state = run(op, case, "cuda")
    used = case["state_slots"].long()
    unused = torch.ones(case["conv_state"].shape[0], dtype=torch.bool)
    unused[used] = False
    e_out, e_state = rel_err(out, ref_out), rel_err(state[used], ref_state[used])
    print(f"\n{label}: rel err out {e_out:.2e}, state {e_state:.2e}")
    assert e_out < tol[0], f"{label}: output rel err {e_out:.3e}"
    assert e_state < tol[1], f"{label}: state rel err {e_state:.3e}"
    assert torch.equal(conv[used], ref_conv[used]), f"{label}: conv state differs"
    assert torch.equal(conv[unused], case["conv_state"][unused]), f"{label}: untouched conv slot changed"
    assert torch.equal(state[unused], case["recurrent_state"][unused]), f"{label}: untouched slot changed"
    return out, state


PREFILL = torch.ops.k3.kda_prefill
DECODE = torch.ops.k3.kda_decode


@pytest.mark.parametrize("name", ["prefill", "decode"])
def test_k3_heads_varlen(name):
    """K3 head shape (96 x 128, lb -5) over lengths around the chunk size, mixed initial states."""
    op, tol = (PREFILL, PREFILL_TOL) if name == "prefill" else (DECODE, DECODE_TOL)
    case = make_case([1, 63, 64, 65, 1024], 96, 128, -5.0, [1, 0, 1, 1, 0], seed=1)
    check_against_reference(case, op, tol, f"K3 96x128 {name}")


@pytest.mark.parametrize("head_dim", [32, 64])
def test_small_heads_long_varlen(head_dim):
    """Tiny heads (the tiny config is 4 x 32) with a 4096-token sequence in the batch."""
    case = make_case([1, 63, 64, 65, 4096], 4, head_dim, -5.0, [1, 1, 0, 1, 1], seed=2 + head_dim)
    check_against_reference(case, PREFILL, PREFILL_TOL, f"prefill 4x{head_dim}")


@pytest.mark.parametrize("lower_bound", [-1.0, 0.0])
def test_other_gates(lower_bound):
    """A weaker bound and the softplus gate (prefill then runs the token recurrence)."""
    case = make_case([5, 130, 64], 2, 64, lower_bound, [1, 0, 1], seed=7)
    check_against_reference(case, PREFILL, PREFILL_TOL, f"prefill lb={lower_bound}")
    check_against_reference(case, DECODE, DECODE_TOL, f"decode lb={lower_bound}")


def test_decode_many_sequences_multi_token():
    """Decode batch: one token per sequence for most, 4 (speculative verify) for some."""
    case = make_case([1] * 40 + [4] * 8 + [2], 8, 128, -5.0, [1] * 45 + [0] * 4, seed=11)
    check_against_reference(case, DECODE, DECODE_TOL, "decode B=49")


@pytest.mark.parametrize("head_dim", [32, 64])
def test_decode_small_heads_many_items(head_dim):
    """Decode at the tiny config's head_dim 32 and at 64, 300 sequences of 1-3 tokens, some
    new: every persistent CTA walks several items through both consumer groups (one item
    apart) and reuses its ring stages."""
    lengths = [1 + i % 3 for i in range(300)]
    initial = [int(i % 5 != 0) for i in range(300)]
    case = make_case(lengths, 4, head_dim, -5.0, initial, seed=17 + head_dim)
    check_against_reference(case, DECODE, DECODE_TOL, f"decode 300 seqs 4x{head_dim}")


def test_decode_k3_heads_batch():
    """Decode at the K3 head shape over a batch: one token for most sequences, 2-3 for some,
    shuffled slots, some new sequences (many items per launch at head_dim 128, as in serving)."""
    lengths = [1] * 30 + [2, 3] * 5
    initial = [int(i % 7 != 3) for i in range(len(lengths))]
    case = make_case(lengths, 96, 128, -5.0, initial, seed=23)
    check_against_reference(case, DECODE, DECODE_TOL, "decode K3 96x128 B=40")


@pytest.mark.parametrize("name", ["prefill", "decode"])
def test_empty_sequences_leave_their_slots_untouched(name):
    """Sequences with no tokens (new or continuing) between non-empty ones: their slots must
    keep their state, the others must not notice them."""
    op, tol = (PREFILL, PREFILL_TOL) if name == "prefill" else (DECODE, DECODE_TOL)
    case = make_case([70, 0, 1, 0, 3], 8, 128, -5.0, [1, 0, 0, 1, 1], seed=29)
    check_against_reference(case, op, tol, f"{name} with empty sequences")
    _, conv, state = run(op, case, "cuda")
    for b in (1, 3):
        slot = int(case["state_slots"][b])
        assert torch.equal(conv[slot], case["conv_state"][slot]), f"{name}: empty sequence {b} changed its conv slot"
        assert torch.equal(state[slot], case["recurrent_state"][slot]), f"{name}: empty sequence {b} changed its slot"


def test_prefill_then_decode_handoff():
    """Prefill of a prompt, then three decode steps (1, 1 and 3 tokens) on the same slots,
    equals one reference pass over the concatenated tokens (conv and state hand-off)."""
    steps = [[150, 70], [1, 1], [1, 1], [3, 1]]
    full = make_case([sum(s[i] for s in steps) for i in range(2)], 8, 128, -5.0, [1, 0], seed=5)
    ref_out, ref_conv, ref_state = run(DECODE, full, "cpu")

    H, K, lb = full["attrs"]
    P3 = 3 * H * K
    cuda = {k: full[k].clone().cuda() for k in ARG_ORDER}
    pos = [0, sum(s[0] for s in steps)]  # offsets of the two sequences in the full batch
    outs = [[], []]
    for i, step in enumerate(steps):
        rows = [torch.arange(pos[j], pos[j] + step[j]) for j in range(2)]
        idx = torch.cat(rows)
        cu = torch.tensor([0, step[0], step[0] + step[1]], dtype=torch.int32).cuda()
        has_init = full["has_initial_state"].cuda() if i == 0 else torch.ones(2, dtype=torch.int32).cuda()
        T = len(idx)
        op = PREFILL if i == 0 else DECODE
        out = op(cuda["qkv"][idx.cuda()].reshape(T, P3), cuda["gate"][idx.cuda()],
                 cuda["beta"][idx.cuda()], cuda["conv_weight"], cuda["A_log"], cuda["dt_bias"], cu,
                 cuda["state_slots"], has_init, cuda["conv_state"], cuda["recurrent_state"], H, K, lb)
        outs[0].append(out[: step[0]].cpu())
        outs[1].append(out[step[0]:].cpu())
        pos = [pos[j] + step[j] for j in range(2)]
    out = torch.cat([torch.cat(outs[0]), torch.cat(outs[1])])
    used = full["state_slots"].long()
    e_out = rel_err(out, ref_out)
    e_state = rel_err(cuda["recurrent_state"].cpu()[used], ref_state[used])
    print(f"\nhand-off: rel err out {e_out:.2e}, state {e_state:.2e}")
    assert e_out < PREFILL_TOL[0] and e_state < PREFILL_TOL[1]
    assert torch.equal(cuda["conv_state"].cpu()[used], ref_conv[used])


@pytest.mark.parametrize("num_heads", [16, 4])
def test_prefill_matches_decode_kernel_on_long_sequence(num_heads):
    """The two CUDA kernels (chunked vs token recurrence) agree on a long K3-head sequence,
    where the CPU reference would be slow: 2048 + 300 tokens, heads x 128. With 4 heads the
    walk runs 16-column value tiles (few CTAs), with 16 heads 32-column ones."""
    case = make_case([2048, 300], num_heads, 128, -5.0, [1, 0], seed=13)
    out_p, _, state_p = run(PREFILL, case, "cuda")
    out_d, _, state_d = run(DECODE, case, "cuda")
    used = case["state_slots"].long()
    e_out, e_state = rel_err(out_p, out_d), rel_err(state_p[used], state_d[used])
    print(f"\nprefill vs decode kernel, {num_heads} heads: rel err out {e_out:.2e}, state {e_state:.2e}")
    assert e_out < PREFILL_TOL[0] and e_state < PREFILL_TOL[1]
