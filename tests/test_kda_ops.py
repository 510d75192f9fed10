"""KDA reference ops (spec §4.5): each test compares two independent computations.

Shapes are tiny (2 heads × 16 channels, conv width 4) so the file runs in seconds;
the sequence lengths straddle the 64-token chunk boundary.
"""
from __future__ import annotations

import itertools
import math

import pytest
import torch
import torch.nn.functional as F

from k3_trtllm.ops.kda import chunk_kda, kda_gate, l2_normalize, recurrent_kda, short_conv

H, K, W = 2, 16, 4
P = H * K
LENGTHS = [1, 63, 64, 65, 200]


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _kernel_inputs(T: int, lower_bound: float, gen: torch.Generator, dtype=torch.float64):
    """q, k, v, g, beta, initial state of one sequence, as the op hands them to the kernels.

    A third of the raw gates are large so that the bounded gate sits at its strongest
    decay (g ≈ lb, Γ ≈ 64·lb = −320 over a chunk)."""
    q = l2_normalize(torch.randn(T, H, K, generator=gen, dtype=dtype))
    k = l2_normalize(torch.randn(T, H, K, generator=gen, dtype=dtype))
    v = torch.randn(T, H, K, generator=gen, dtype=dtype)
    raw = torch.randn(T, H, K, generator=gen, dtype=dtype) * 2
    raw[torch.rand(T, H, K, generator=gen) < 1 / 3] = 30.0
    A_log = torch.randn(H, generator=gen, dtype=dtype) * 0.5
    dt_bias = torch.randn(H, K, generator=gen, dtype=dtype)
    g = kda_gate(raw, A_log, dt_bias, lower_bound)
    beta = torch.sigmoid(torch.randn(T, H, generator=gen, dtype=dtype))
    state = torch.randn(H, K, K, generator=gen, dtype=dtype)
    return q, k, v, g, beta, state


# ---------------------------------------------------------------------------
# 1. chunked form == token recurrence (fp64)
# ---------------------------------------------------------------------------
@pytest.mark.parametrize("lower_bound", [-5.0, 0.0])
def test_chunk_equals_recurrent_fp64(lower_bound):
    gen = _gen(1)
    for T in LENGTHS:
        q, k, v, g, beta, state = _kernel_inputs(T, lower_bound, gen)
        o_ref, s_ref = recurrent_kda(q, k, v, g, beta, K ** -0.5, state)
        o, s = chunk_kda(q, k, v, g, beta, K ** -0.5, state)
        assert torch.isfinite(o).all() and torch.isfinite(s).all()
        # fp64, O(1) values: only summation order differs (~1e-15); 1e-10 leaves headroom
        torch.testing.assert_close(o, o_ref, rtol=0, atol=1e-10, msg=f"output, T={T}")
        torch.testing.assert_close(s, s_ref, rtol=0, atol=1e-10, msg=f"state, T={T}")


def test_chunk_fp32_strongest_decay_stays_finite():
    """In fp32, e^{+Γ} and e^{−Γ} over-/underflow across a chunk (|Γ| up to 320): the
    chunked form must only exponentiate masked differences Γ_r − Γ_j (§7.3), never
    factor them as exp(Γ_r)·exp(−Γ_j), and still match the recurrence."""
    q, k, v, g, beta, state = _kernel_inputs(130, -5.0, _gen(9), dtype=torch.float32)
    g = torch.full_like(g, -5.0)
    o_ref, s_ref = recurrent_kda(q, k, v, g, beta, K ** -0.5, state)
    o, s = chunk_kda(q, k, v, g, beta, K ** -0.5, state)
    assert torch.isfinite(o).all() and torch.isfinite(s).all()
    # fp32 summation-order noise on O(1) values
    torch.testing.assert_close(o, o_ref, rtol=0, atol=1e-5)
    torch.testing.assert_close(s, s_ref, rtol=0, atol=1e-5)


def test_chunk_size_does_not_matter_and_zero_state_default():
    gen = _gen(2)
    q, k, v, g, beta, _ = _kernel_inputs(70, -5.0, gen)
    o64, s64 = chunk_kda(q, k, v, g, beta, 0.25, None)
    o16, s16 = chunk_kda(q, k, v, g, beta, 0.25, torch.zeros(H, K, K, dtype=torch.float64), chunk_size=16)
    torch.testing.assert_close(o16, o64, rtol=0, atol=1e-12)
    torch.testing.assert_close(s16, s64, rtol=0, atol=1e-12)


# ---------------------------------------------------------------------------
# 5. token recurrence vs a direct V-major transcription of §4.5.6
# ---------------------------------------------------------------------------
def test_recurrent_matches_v_major_definition():
    gen = _gen(3)
    T = 40
    q, k, v, g, beta, state = _kernel_inputs(T, 0.0, gen)
    scale = K ** -0.5
    o, s = recurrent_kda(q, k, v, g, beta, scale, state)
    for h in range(H):
        M = state[h].T.clone()  # V-major [V, K]
        for t in range(T):
            M = M @ torch.diag(torch.exp(g[t, h]))
            u = beta[t, h] * (v[t, h] - M @ k[t, h])
            M = M + torch.outer(u, k[t, h])
            torch.testing.assert_close(o[t, h], M @ (scale * q[t, h]), rtol=0, atol=1e-12)
        torch.testing.assert_close(s[h], M.T, rtol=0, atol=1e-12)


# ---------------------------------------------------------------------------
# 4. short conv vs torch's grouped conv1d; state continuation == one long conv
# ---------------------------------------------------------------------------
def _conv1d_silu(x, weight, initial):
    """Depthwise conv written as conv1d(groups=C) over the left-padded sequence."""
    padded = torch.cat([initial.T, x], 0).T[None]  # [1, C, W-1+T]
    return F.silu(F.conv1d(padded, weight[:, None, :], groups=x.shape[1]))[0].T


def test_short_conv_matches_conv1d():
    gen = _gen(4)
    C = 12
    x = torch.randn(9, C, generator=gen, dtype=torch.float64)
    w = torch.randn(C, W, generator=gen, dtype=torch.float64)
    init = torch.randn(C, W - 1, generator=gen, dtype=torch.float64)
    for initial in (None, init):
        y, final = short_conv(x, w, initial)
        expected = _conv1d_silu(x, w, torch.zeros(C, W - 1, dtype=x.dtype) if initial is None else initial)
        torch.testing.assert_close(y, expected, rtol=0, atol=1e-13)
        torch.testing.assert_close(final, x[-(W - 1):].T)


def test_short_conv_continuation_equals_one_long_conv():
    gen = _gen(5)
    C = 6
    x = torch.randn(20, C, generator=gen, dtype=torch.float64)
    w = torch.randn(C, W, generator=gen, dtype=torch.float64)
    y_full, final_full = short_conv(x, w, None)
    state, pieces = None, []
    # pieces shorter than W-1 make the state carry values from earlier pieces
    for a, b in [(0, 1), (1, 3), (3, 3), (3, 10), (10, 11), (11, 20)]:
        y, state = short_conv(x[a:b], w, state)
        pieces.append(y)
    # same products and sums; vectorised and scalar loop tails may round differently
    torch.testing.assert_close(torch.cat(pieces), y_full, rtol=0, atol=1e-14)
    assert torch.equal(state, final_full)
    # after one token from a fresh start the state is [0, 0, x0]
    _, first = short_conv(x[:1], w, None)
    assert torch.equal(first, torch.cat([torch.zeros(C, W - 2, dtype=x.dtype), x[:1].T], 1))


def test_short_conv_bf16_computes_in_fp32():
    gen = _gen(6)
    x = torch.randn(7, 5, generator=gen).bfloat16()
    w = torch.randn(5, W, generator=gen)
    y, final = short_conv(x, w, None)
    assert y.dtype == torch.float32 and final.dtype == torch.bfloat16
    torch.testing.assert_close(y, _conv1d_silu(x.float(), w, torch.zeros(5, W - 1)), rtol=1e-6, atol=1e-6)


# ---------------------------------------------------------------------------
# 6. gates
# ---------------------------------------------------------------------------
def test_lower_bound_gate_stays_inside_bounds():
    gen = _gen(7)
    raw = torch.randn(50, H, K, generator=gen, dtype=torch.float64) * 4
    A_log = torch.randn(H, generator=gen, dtype=torch.float64) * 0.5
    dt_bias = torch.randn(H, K, generator=gen, dtype=torch.float64)
    g = kda_gate(raw, A_log, dt_bias, -5.0)
    assert bool((g > -5.0).all()) and bool((g < 0.0).all())
    # monotone in the raw gate: a larger raw value decays more
    assert bool((kda_gate(raw + 1, A_log, dt_bias, -5.0) < g).all())


def test_softplus_gate_matches_log1p_exp():
    gen = _gen(8)
    raw = torch.linspace(-30, 30, H * K * 5, dtype=torch.float64).reshape(5, H, K)
    A_log = torch.randn(H, generator=gen, dtype=torch.float64)
    dt_bias = torch.randn(H, K, generator=gen, dtype=torch.float64)
    g = kda_gate(raw, A_log, dt_bias, 0.0)
    z = raw + dt_bias
    expected = -torch.exp(A_log)[:, None] * torch.log1p(torch.exp(z))
    # above z = 20 softplus is taken as z: error log1p(e^-z)·a <= 2.1e-9·a
    torch.testing.assert_close(g, expected, rtol=1e-12, atol=3e-9 * float(torch.exp(A_log).max()))
    assert bool((g < 0).all())


# ---------------------------------------------------------------------------
# op level
# ---------------------------------------------------------------------------
def _no_snapshots(num_seqs, dtype, state_dtype):
    """The snapshot inputs of a step that takes none: one -1 column, one-row pools."""
    return dict(snapshot_offsets=torch.full((num_seqs, 1), -1, dtype=torch.int32),
                snapshot_rows=torch.zeros(num_seqs, 1, dtype=torch.int32),
                snapshot_conv=torch.zeros(1, 3 * P, W - 1, dtype=dtype),
                snapshot_recurrent=torch.zeros(1, H, K, K, dtype=state_dtype))


def _op_inputs(lengths, flags, slots, num_slots, dtype, state_dtype, gen, lower_bound=-5.0):
    T = sum(lengths)
    args = dict(
        qkv=torch.randn(T, 3 * P, generator=gen).to(dtype),
        gate=torch.randn(T, P, generator=gen).to(dtype),
        beta=torch.randn(T, H, generator=gen).to(dtype),
        conv_weight=(torch.randn(3 * P, W, generator=gen) * 0.5).to(state_dtype),
        A_log=(torch.randn(H, generator=gen) * 0.5).to(state_dtype),
        dt_bias=torch.randn(P, generator=gen).to(state_dtype),
        cu_seqlens=torch.tensor(list(itertools.accumulate(lengths, initial=0)), dtype=torch.int32),
        state_slots=torch.tensor(slots, dtype=torch.int32),
        has_initial_state=torch.tensor(flags, dtype=torch.int32),
        conv_state=torch.randn(num_slots, 3 * P, W - 1, generator=gen).to(dtype),
        recurrent_state=(torch.randn(num_slots, H, K, K, generator=gen) * 0.3).to(state_dtype),
        **_no_snapshots(len(lengths), dtype, state_dtype),
    )
    return args, (H, K, lower_bound)


def _run(op, args, attrs, **overrides):
    """Run an op on copies of the caches; returns (out, conv_state, recurrent_state)."""
    a = dict(args, **overrides)
    conv_state, rec_state = a["conv_state"].clone(), a["recurrent_state"].clone()
    a["conv_state"], a["recurrent_state"] = conv_state, rec_state
    out = op(*a.values(), *attrs)
    return out, conv_state, rec_state


def _one_seq(args, start, end, slot, continues):
    """The metadata of a step holding tokens [start, end) of one sequence."""
    return dict(
        qkv=args["qkv"][start:end], gate=args["gate"][start:end], beta=args["beta"][start:end],
        cu_seqlens=torch.tensor([0, end - start], dtype=torch.int32),
        state_slots=torch.tensor([slot], dtype=torch.int32),
        has_initial_state=torch.tensor([continues], dtype=torch.int32),
        snapshot_offsets=torch.full((1, 1), -1, dtype=torch.int32),
        snapshot_rows=torch.zeros(1, 1, dtype=torch.int32),
    )


# 2. prefill (chunked) == decode (recurrent) on a whole varlen batch
@pytest.mark.parametrize("lower_bound", [-5.0, 0.0])
def test_prefill_op_equals_decode_op_fp64(lower_bound):
    lengths = [1, 63, 65, 130, 2]
    flags = [1, 0, 1, 1, 0]
    slots = [6, 0, 3, 1, 4]
    args, attrs = _op_inputs(lengths, flags, slots, 7, torch.float64, torch.float64, _gen(10), lower_bound)
    out_p, conv_p, rec_p = _run(torch.ops.k3.kda_prefill, args, attrs)
    out_d, conv_d, rec_d = _run(torch.ops.k3.kda_decode, args, attrs)
    assert out_p.shape == (sum(lengths), P) and out_p.dtype == torch.float64
    torch.testing.assert_close(out_p, out_d, rtol=0, atol=1e-10)  # fp64, summation order only
    torch.testing.assert_close(rec_p, rec_d, rtol=0, atol=1e-10)
    assert torch.equal(conv_p, conv_d)
    # rows not owned by a sequence of the batch are untouched
    for untouched in (2, 5):
        assert torch.equal(rec_p[untouched], args["recurrent_state"][untouched])
        assert torch.equal(conv_p[untouched], args["conv_state"][untouched])
    # every owned row changed (guards against states written to the wrong slot)
    for s in slots:
        assert not torch.equal(rec_p[s], args["recurrent_state"][s])


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16])
def test_op_matches_naive_pipeline(dtype):
    """The op == naive functions chained by hand: conv, rounding to the activation dtype,
    head split, l2-norm, scale, gate, beta. fp64 runs the token recurrence here against
    the op's chunked form; bf16 runs the same chunked fp32 arithmetic, so it must agree
    bit for bit and pins where the rounding happens (a missing or extra rounding moves
    the output by bf16 ulps)."""
    state_dtype = torch.float64 if dtype == torch.float64 else torch.float32
    args, (_, _, lb) = _op_inputs([70], [1], [1], 2, dtype, state_dtype, _gen(11))
    out, conv_state, rec_state = _run(torch.ops.k3.kda_prefill, args, (H, K, lb))
    y, conv_final = short_conv(args["qkv"], args["conv_weight"], args["conv_state"][1])
    y = y.to(dtype).to(state_dtype)
    q, k, v = (y[:, i * P:(i + 1) * P].reshape(-1, H, K) for i in range(3))
    g = kda_gate(args["gate"].to(state_dtype).reshape(-1, H, K), args["A_log"], args["dt_bias"].reshape(H, K), lb)
    beta = torch.sigmoid(args["beta"].to(state_dtype))
    form = recurrent_kda if dtype == torch.float64 else chunk_kda
    o, final = form(l2_normalize(q), l2_normalize(k), v, g, beta, 1 / math.sqrt(K), args["recurrent_state"][1])
    if dtype == torch.float64:
        torch.testing.assert_close(out, o.reshape(-1, P), rtol=0, atol=1e-10)
        torch.testing.assert_close(rec_state[1], final, rtol=0, atol=1e-10)
    else:
        assert torch.equal(out, o.reshape(-1, P).to(dtype))
        assert torch.equal(rec_state[1], final)
    assert torch.equal(conv_state[1], conv_final)


def test_functional_twin_returns_caches_and_leaves_inputs_alone():
    args, attrs = _op_inputs([5, 3], [1, 0], [0, 1], 2, torch.float32, torch.float32, _gen(12))
    before = {n: t.clone() for n, t in args.items()}
    out_f, conv_f, rec_f, snap_conv_f, snap_rec_f = torch.ops.k3.kda_decode_functional(*args.values(), *attrs)
    for n, t in args.items():
        assert torch.equal(t, before[n]), n
    out, conv_state, rec_state = _run(torch.ops.k3.kda_decode, args, attrs)
    assert torch.equal(out_f, out) and torch.equal(conv_f, conv_state) and torch.equal(rec_f, rec_state)
    assert torch.equal(snap_conv_f, args["snapshot_conv"]) and torch.equal(snap_rec_f, args["snapshot_recurrent"])


@pytest.mark.parametrize("name", ["kda_prefill", "kda_decode", "kda_prefill_functional", "kda_decode_functional"])
def test_opcheck_schema_fake_and_mutation(name):
    """torch's own checks: the schema's mutation annotations match what the op writes,
    and the fake function's shapes/dtypes match the real outputs (needed by export)."""
    args, attrs = _op_inputs([5, 3], [1, 0], [0, 1], 2, torch.bfloat16, torch.float32, _gen(13))
    op = getattr(torch.ops.k3, name).default
    torch.library.opcheck(op, (*args.values(), *attrs),
                          test_utils=("test_schema", "test_faketensor", "test_aot_dispatch_dynamic"))


# 3. prefix prefill, then token-by-token decode == one full prefill
@pytest.mark.parametrize(
    "dtype, state_dtype, atol_out, atol_state",
    [
        # fp64: summation order only
        (torch.float64, torch.float64, 1e-10, 1e-10),
        # fp32: chunked vs token summation order over 100 tokens; seen 5e-8 on |o| < 0.4
        # and 8e-7 on |state| < 1
        (torch.float32, torch.float32, 1e-6, 1e-5),
        # bf16 activations, fp32 state: the fp32 results differ by ~1e-7, so the bf16
        # output can land at most one ulp apart (2^-8 relative, |o| < 0.5 -> 2e-3)
        (torch.bfloat16, torch.float32, 4e-3, 1e-5),
    ],
)
def test_prefix_prefill_then_decode_equals_full_prefill(dtype, state_dtype, atol_out, atol_state):
    T, prefix = 100, 67
    args, attrs = _op_inputs([T], [1], [2], 3, dtype, state_dtype, _gen(14))
    full_out, full_conv, full_rec = _run(torch.ops.k3.kda_prefill, args, attrs)

    conv_state, rec_state = args["conv_state"].clone(), args["recurrent_state"].clone()
    caches = dict(conv_state=conv_state, recurrent_state=rec_state)
    outs = [torch.ops.k3.kda_prefill(*dict(args, **_one_seq(args, 0, prefix, 2, 1), **caches).values(), *attrs)]
    for t in range(prefix, T):
        step = dict(args, **_one_seq(args, t, t + 1, 2, 1), **caches)
        outs.append(torch.ops.k3.kda_decode(*step.values(), *attrs))
    out = torch.cat(outs)

    assert out.dtype == dtype and rec_state.dtype == state_dtype
    torch.testing.assert_close(out, full_out, rtol=0, atol=atol_out)
    torch.testing.assert_close(rec_state, full_rec, rtol=0, atol=atol_state)
    assert torch.equal(conv_state, full_conv)  # raw inputs, copied exactly


@pytest.mark.parametrize("empty_has_initial_state", [1, 0])
def test_zero_length_sequence_keeps_its_state(empty_has_initial_state):
    """An empty sequence is a no-op whether or not it is marked new (the kernels skip it too,
    so padding rows of a fixed-size batch cannot clobber a slot)."""
    args, attrs = _op_inputs([4, 0, 3], [1, empty_has_initial_state, 0], [0, 1, 2], 3, torch.float64,
                             torch.float64, _gen(15))
    out, conv_state, rec_state = _run(torch.ops.k3.kda_prefill, args, attrs)
    assert out.shape == (7, P)
    assert torch.equal(conv_state[1], args["conv_state"][1])
    assert torch.equal(rec_state[1], args["recurrent_state"][1])
    # and the other sequences are unaffected by its presence
    alone, _, _ = _run(torch.ops.k3.kda_prefill, args, attrs, **_one_seq(args, 4, 7, 2, 0))
    torch.testing.assert_close(out[4:], alone, rtol=0, atol=0)


# 7. bad inputs raise ValueError naming the tensor: the contract's check for shapes and
# dtypes (naming the op), the op's own checks for the values
_I32 = torch.int32
_BAD_INPUTS = {  # case: (tensor the message must name, replacement of that tensor, message after "<op>: ")
    "qkv_width": ("qkv", lambda a: a["qkv"][:, :-1], r"qkv: shape \[8, 95\], expected \[T, 3\*P\] = \[8, 96\]"),
    "gate_rows": ("gate", lambda a: a["gate"][:-1], r"gate: shape \[7, 32\], expected \[T, P\] = \[8, 32\]"),
    "beta_dtype": ("beta", lambda a: a["beta"].float(), "beta: dtype float32, expected act = float64"),
    "conv_weight_rows": ("conv_weight", lambda a: a["conv_weight"][:-3], r"conv_weight: shape \[93, 4\]"),
    "dt_bias_width": ("dt_bias", lambda a: a["dt_bias"][:-1], r"dt_bias: shape \[31\], expected \[P\] = \[32\]"),
    "conv_state_width": ("conv_state", lambda a: a["conv_state"][:, :, :-1],
                         r"conv_state: shape \[3, 96, 2\], expected \[S, 3\*P, W-1\] = \[3, 96, 3\]"),
    "recurrent_state_slots": ("recurrent_state", lambda a: a["recurrent_state"][:1],
                              r"recurrent_state: shape \[1, 2, 16, 16\], expected \[S, H, K, V\] = \[3, 2, 16, 16\] "
                              r"\(S bound by conv_state"),
    "cu_seqlens_int64": ("cu_seqlens", lambda a: a["cu_seqlens"].long(), "cu_seqlens: dtype int64, expected int32"),
    "cu_seqlens_decreasing": ("cu_seqlens", lambda a: torch.tensor([0, 6, 5, 8], dtype=_I32),
                              "kda: cu_seqlens must be non-decreasing"),
    "state_slots_out_of_range": ("state_slots", lambda a: torch.tensor([0, 3, 1], dtype=_I32),
                                 "kda: state_slots must index rows"),
    "state_slots_repeated": ("state_slots", lambda a: torch.tensor([1, 1, 0], dtype=_I32),
                             "kda: state_slots must be distinct"),
    "has_initial_state_value": ("has_initial_state", lambda a: torch.tensor([0, 2, 1], dtype=_I32),
                                "kda: has_initial_state must hold 0 or 1"),
}


@pytest.mark.parametrize("case", list(_BAD_INPUTS))
def test_bad_inputs_raise_value_error(case):
    args, attrs = _op_inputs([4, 2, 2], [1, 0, 1], [0, 1, 2], 3, torch.float64, torch.float64, _gen(16))
    name, replace, message = _BAD_INPUTS[case]
    for op in ("kda_prefill", "kda_decode"):
        prefix = "" if message.startswith("kda: ") else f"k3::{op}: "
        with pytest.raises(ValueError, match="^" + prefix + message):
            _run(getattr(torch.ops.k3, op), args, attrs, **{name: replace(args)})


def test_bad_attributes_raise_value_error():
    args, _ = _op_inputs([3], [0], [0], 1, torch.float64, torch.float64, _gen(17))
    # head_dim fixes P: qkv's width is then 3*P for the given attributes, not for K
    with pytest.raises(ValueError, match=rf"k3::kda_prefill: qkv: shape \[3, {3 * P}\], expected \[T, 3\*P\] = "
                                         rf"\[3, {3 * P // 2}\] \(P bound by num_heads\*head_dim\)"):
        _run(torch.ops.k3.kda_prefill, args, (H, K // 2, -5.0))
    with pytest.raises(ValueError, match="lower_bound"):
        _run(torch.ops.k3.kda_prefill, args, (H, K, -6.0))


# ---------------------------------------------------------------------------
# 8. prefix-cache snapshots written by the prefill (issue 22)
# ---------------------------------------------------------------------------
def test_naive_forms_snapshot_the_state_of_the_prefix():
    """Both forms' snapshots == the final state of the first n tokens run alone (fp64)."""
    q, k, v, g, beta, state = _kernel_inputs(150, -5.0, _gen(20))
    for form, points in ((chunk_kda, (64, 128, 150)), (recurrent_kda, (1, 64, 100, 150))):
        snaps = dict.fromkeys(points)
        _, final = form(q, k, v, g, beta, K ** -0.5, state, snaps)
        for n in points:
            _, alone = recurrent_kda(q[:n], k[:n], v[:n], g[:n], beta[:n], K ** -0.5, state)
            torch.testing.assert_close(snaps[n], alone, rtol=0, atol=1e-10, msg=f"{form.__name__} at {n}")
        assert torch.equal(snaps[150], final)
    with pytest.raises(ValueError, match=r"no state after \[100\] tokens"):
        chunk_kda(q, k, v, g, beta, K ** -0.5, state, {100: None})


_SNAP_LENGTHS, _SNAP_FLAGS, _SNAP_SLOTS = [200, 1, 130, 64, 70], [1, 0, 1, 0, 0], [3, 0, 5, 1, 2]
# per sequence: its points (a multiple of 64 or its token count) and their rows
_SNAP_POINTS = [[(64, 4), (128, 0), (200, 6)], [(1, 2)], [(128, 1)], [], [(64, 5), (70, 3)]]


def _snapshot_inputs(points, num_rows, dtype, state_dtype, gen):
    width = max(1, max(len(p) for p in points))
    offsets = torch.full((len(points), width), -1, dtype=torch.int32)
    rows = torch.zeros(len(points), width, dtype=torch.int32)
    for b, p in enumerate(points):
        for i, (o, r) in enumerate(p):
            offsets[b, i], rows[b, i] = o, r
    return dict(snapshot_offsets=offsets, snapshot_rows=rows,
                snapshot_conv=torch.randn(num_rows, 3 * P, W - 1, generator=gen).to(dtype),
                snapshot_recurrent=torch.randn(num_rows, H, K, K, generator=gen).to(state_dtype))


@pytest.mark.parametrize("lower_bound", [-5.0, 0.0])
def test_prefill_snapshots_equal_the_state_after_the_prefix_alone(lower_bound):
    """Each snapshot row == the conv / recurrent state row a separate call over the first n tokens
    of that sequence leaves (fp64); outputs and final states do not change; other rows stay."""
    gen = _gen(21)
    args, attrs = _op_inputs(_SNAP_LENGTHS, _SNAP_FLAGS, _SNAP_SLOTS, 6, torch.float64, torch.float64, gen,
                             lower_bound)
    plain = _run(torch.ops.k3.kda_prefill, args, attrs)
    snaps = _snapshot_inputs(_SNAP_POINTS, 8, torch.float64, torch.float64, gen)
    before = {n: snaps[n].clone() for n in ("snapshot_conv", "snapshot_recurrent")}
    taken = _run(torch.ops.k3.kda_prefill, dict(args, **snaps), attrs)
    for a, b in zip(plain, taken):
        assert torch.equal(a, b)
    starts = list(itertools.accumulate(_SNAP_LENGTHS, initial=0))
    written = set()
    for b, points in enumerate(_SNAP_POINTS):
        for n, row in points:
            _, conv, rec = _run(torch.ops.k3.kda_prefill, args, attrs,
                                **_one_seq(args, starts[b], starts[b] + n, _SNAP_SLOTS[b], _SNAP_FLAGS[b]))
            assert torch.equal(snaps["snapshot_conv"][row], conv[_SNAP_SLOTS[b]]), (b, n)
            torch.testing.assert_close(snaps["snapshot_recurrent"][row], rec[_SNAP_SLOTS[b]], rtol=0, atol=1e-12,
                                       msg=f"sequence {b} at {n}")
            written.add(row)
    for row in set(range(8)) - written:
        assert torch.equal(snaps["snapshot_conv"][row], before["snapshot_conv"][row])
        assert torch.equal(snaps["snapshot_recurrent"][row], before["snapshot_recurrent"][row])


_BAD_SNAPSHOTS = {  # case: (offsets, rows of a 3-sequence step [4, 2, 70], message after "k3::kda_prefill: ")
    "not_a_chunk_boundary": ([[3, -1], [-1, -1], [-1, -1]], [[0, 0], [0, 0], [0, 0]], "snapshot_offsets row 0"),
    "past_the_sequence": ([[-1, -1], [-1, -1], [128, -1]], [[0, 0], [0, 0], [0, 0]], "snapshot_offsets row 2"),
    "not_increasing": ([[-1, -1], [-1, -1], [70, 64]], [[0, 0], [0, 0], [0, 1]], "snapshot_offsets row 2"),
    "gap_before_a_point": ([[-1, 4], [-1, -1], [-1, -1]], [[0, 0], [0, 0], [0, 0]],
                           r"snapshot_offsets row 0 \[-1, 4\]: -1 entries must come last"),
    "row_out_of_range": ([[4, -1], [-1, -1], [-1, -1]], [[2, 0], [0, 0], [0, 0]], "snapshot_rows 2 of sequence 0"),
    "row_twice": ([[4, -1], [2, -1], [-1, -1]], [[1, 0], [1, 0], [0, 0]], "snapshot_rows 1 of sequence 1"),
    # the kernels' own check (chunk.cuh snapshot_entry_bad) refuses these too (tests/gpu/test_kda_cuda.py)
    "zero_point": ([[0, -1], [-1, -1], [-1, -1]], [[0, 0], [0, 0], [0, 0]], "snapshot_offsets row 0"),
    "negative_point": ([[-1, -1], [-5, -1], [-1, -1]], [[0, 0], [0, 0], [0, 0]], "snapshot_offsets row 1"),
    "repeated_point": ([[-1, -1], [-1, -1], [64, 64]], [[0, 0], [0, 0], [0, 1]], "snapshot_offsets row 2"),
    "negative_row": ([[4, -1], [-1, -1], [-1, -1]], [[-1, 0], [0, 0], [0, 0]], "snapshot_rows -1 of sequence 0"),
}


@pytest.mark.parametrize("case", list(_BAD_SNAPSHOTS))
def test_bad_snapshot_inputs_raise_value_error(case):
    args, attrs = _op_inputs([4, 2, 70], [1, 0, 1], [0, 1, 2], 3, torch.float64, torch.float64, _gen(22))
    offsets, rows, message = _BAD_SNAPSHOTS[case]
    bad = dict(snapshot_offsets=torch.tensor(offsets, dtype=_I32), snapshot_rows=torch.tensor(rows, dtype=_I32),
               snapshot_conv=torch.zeros(2, 3 * P, W - 1, dtype=torch.float64),
               snapshot_recurrent=torch.zeros(2, H, K, K, dtype=torch.float64))
    with pytest.raises(ValueError, match="^k3::kda_prefill: " + message):
        _run(torch.ops.k3.kda_prefill, args, attrs, **bad)


def test_decode_takes_no_snapshots():
    args, attrs = _op_inputs([1, 1], [1, 1], [0, 1], 2, torch.float64, torch.float64, _gen(23))
    with pytest.raises(ValueError, match="^k3::kda_decode: takes no snapshots"):
        _run(torch.ops.k3.kda_decode, args, attrs, snapshot_offsets=torch.tensor([[1], [-1]], dtype=_I32))
