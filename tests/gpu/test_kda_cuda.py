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
- prefill snapshots (prefix cache): the same fp32 accumulators stored at a chunk boundary, so
  state rows < 5e-3 against the reference's chunked form; conv rows are raw inputs: exact. The
  softplus gate's prefill (token recurrence, all fp32) stores its state after the point's token:
  < 1e-4 against the chunked fp32 reference (the two forms differ by 2e-6 on the CPU at that
  test's shape, summation order only). Snapshot tables that break the contract: no row written,
  and the refusal reaches the caller (ops/kda/verdicts.py: a full ring keeps the verdict of the
  call that raised, one ring per device, the torch executor raises it from the step).
Skips without CUDA or without build/libk3_kernels.so.
"""
from __future__ import annotations

import warnings

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
        # no prefix-cache snapshots: one -1 column, one-row pools (test_prefill_snapshots sets them)
        snapshot_offsets=torch.full((B, 1), -1, dtype=torch.int32),
        snapshot_rows=torch.zeros(B, 1, dtype=torch.int32),
        snapshot_conv=randn(1, 3 * P, W - 1).bfloat16(),
        snapshot_recurrent=randn(1, H, K, K),
        attrs=(H, K, float(lower_bound)),
    )


ARG_ORDER = ("qkv", "gate", "beta", "conv_weight", "A_log", "dt_bias", "cu_seqlens", "state_slots",
             "has_initial_state", "conv_state", "recurrent_state", "snapshot_offsets", "snapshot_rows",
             "snapshot_conv", "snapshot_recurrent")


def run(op, case, device, snapshots=False):
    tensors = {k: case[k].clone().to(device) for k in ARG_ORDER}
    out = op(*(tensors[k] for k in ARG_ORDER), *case["attrs"])
    result = out.cpu(), tensors["conv_state"].cpu(), tensors["recurrent_state"].cpu()
    return result + (tensors["snapshot_conv"].cpu(), tensors["snapshot_recurrent"].cpu()) if snapshots else result


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


def test_decode_one_token_many_items():
    """Serving decode at head_dim 128: one token per sequence, 1000 sequences x 4 heads, so every
    persistent CTA walks ~30 items back to back through the ring (where the ring's phase bugs
    showed: session 16), with shuffled slots and some new sequences."""
    lengths = [1] * 1000
    initial = [int(i % 7 != 5) for i in range(len(lengths))]
    case = make_case(lengths, 4, 128, -5.0, initial, seed=31)
    check_against_reference(case, DECODE, DECODE_TOL, "decode 1000 seqs 4x128, one token")


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
                 cuda["state_slots"], has_init, cuda["conv_state"], cuda["recurrent_state"],
                 *(cuda[k] for k in ARG_ORDER[-4:]), H, K, lb)
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


# Prefix-cache snapshots (issue 22): per sequence, points at chunk boundaries and at its token
# count, into shuffled rows of a pool with spare rows.
SHORT = ([1, 200, 64, 1100, 70, 5], [1, 0, 1, 1, 0, 1],
         [[1], [64, 128, 200], [64], [64, 512, 576, 1024, 1100], [64, 70], []])
# over 1024 tokens a sequence on average: the walk's two-stage (prefetching) variant
LONG = ([2100, 64], [1, 0], [[64, 1024, 2048, 2100], [64]])


@pytest.mark.parametrize("num_heads, head_dim, batch", [(12, 128, SHORT), (12, 128, LONG), (4, 32, SHORT)],
                         ids=["k3-tp8-rank", "k3-tp8-rank-long", "tiny"])
def test_prefill_snapshots(num_heads, head_dim, batch):
    """The chunked kernel's snapshot rows against the fp32 reference's (chunked form on the CPU):
    conv rows exact (raw inputs), recurrent rows within the prefill state tolerance; the output
    and final states are bit-identical to a run without snapshots; rows not asked for stay."""
    lengths, initial, points_per_seq = batch
    case = make_case(lengths, num_heads, head_dim, -5.0, initial, seed=31 + head_dim)
    plain = run(PREFILL, case, "cuda")
    H, K, _ = case["attrs"]
    g = torch.Generator().manual_seed(3)
    num_rows = sum(map(len, points_per_seq)) + 3
    rows = torch.randperm(num_rows, generator=g).tolist()
    width = max(map(len, points_per_seq))
    offsets = torch.full((len(points_per_seq), width), -1, dtype=torch.int32)
    dest = torch.zeros_like(offsets)
    for b, points in enumerate(points_per_seq):
        for i, o in enumerate(points):
            offsets[b, i], dest[b, i] = o, rows.pop()
    case.update(snapshot_offsets=offsets, snapshot_rows=dest,
                snapshot_conv=torch.randn(num_rows, 3 * H * K, CONV_WIDTH - 1, generator=g).bfloat16(),
                snapshot_recurrent=torch.randn(num_rows, H, K, K, generator=g))
    ref = run(PREFILL, case, "cpu", snapshots=True)
    got = run(PREFILL, case, "cuda", snapshots=True)
    for a, b in zip(plain, got):
        assert torch.equal(a, b), "snapshots changed the output or the final states"
    taken = dest[offsets >= 0].long()
    spare = torch.ones(num_rows, dtype=torch.bool)
    spare[taken] = False
    assert torch.equal(got[3][taken], ref[3][taken]), "snapshot conv rows differ"
    for row in taken.tolist():
        e = rel_err(got[4][row], ref[4][row])
        assert e < PREFILL_TOL[1], f"snapshot row {row}: rel err {e:.3e}"
    print(f"\nsnapshots {num_heads}x{head_dim}: worst state rel err "
          f"{max(rel_err(got[4][r], ref[4][r]) for r in taken.tolist()):.2e} over {len(taken)} rows")
    assert torch.equal(got[3][spare], case["snapshot_conv"][spare])
    assert torch.equal(got[4][spare], case["snapshot_recurrent"][spare])


def snapshot_case(lengths, initial, points_per_seq, num_heads, head_dim, lower_bound, seed, rows=None, spare=3):
    """make_case with snapshot points (per sequence a list; padded with -1) into shuffled rows of a
    pool with ``spare`` rows more than taken (``rows``: the row of each point, as given)."""
    case = make_case(lengths, num_heads, head_dim, lower_bound, initial, seed=seed)
    H, K, _ = case["attrs"]
    g = torch.Generator().manual_seed(seed + 1)
    num_rows = sum(o != -1 for points in points_per_seq for o in points) + spare
    order = torch.randperm(num_rows, generator=g).tolist()
    width = max(1, max(map(len, points_per_seq)))
    offsets = torch.full((len(points_per_seq), width), -1, dtype=torch.int32)
    dest = torch.zeros_like(offsets)
    for b, points in enumerate(points_per_seq):
        for i, o in enumerate(points):
            offsets[b, i] = o
            dest[b, i] = rows[b][i] if rows is not None else (order.pop() if o != -1 else 0)
    case.update(snapshot_offsets=offsets, snapshot_rows=dest,
                snapshot_conv=torch.randn(num_rows, 3 * H * K, CONV_WIDTH - 1, generator=g).bfloat16(),
                snapshot_recurrent=torch.randn(num_rows, H, K, K, generator=g))
    return case


def test_softplus_prefill_snapshots_from_the_kernel():
    """The softplus gate's prefill (token-recurrence kernel) writes the snapshots itself, no
    fallback: conv rows exact, recurrent rows against the reference's (chunked fp32) within the
    decode kernel's state tolerance (both fp32, summation order only); rows not asked for stay."""
    case = snapshot_case([70, 3, 200], [1, 0, 1], [[64, 70], [3], [64, 128, 192, 200]], 2, 64, 0.0, seed=37)
    with warnings.catch_warnings():
        warnings.simplefilter("error", kernels.KernelFallbackWarning)
        got = run(PREFILL, case, "cuda", snapshots=True)
    kda_kernels.check_snapshot_verdicts()
    ref = run(PREFILL, case, "cpu", snapshots=True)
    plain = run(PREFILL, dict(case, snapshot_offsets=torch.full_like(case["snapshot_offsets"], -1)), "cuda")
    for a, b in zip(plain, got):
        assert torch.equal(a, b), "snapshots changed the output or the final states"
    offsets, dest = case["snapshot_offsets"], case["snapshot_rows"]
    taken = dest[offsets >= 0].long()
    spare = torch.ones(case["snapshot_conv"].shape[0], dtype=torch.bool)
    spare[taken] = False
    assert torch.equal(got[3][taken], ref[3][taken]), "snapshot conv rows differ"
    worst = max(rel_err(got[4][r], ref[4][r]) for r in taken.tolist())
    print(f"\nsoftplus snapshots: worst state rel err {worst:.2e} over {len(taken)} rows")
    assert worst < DECODE_TOL[1]
    assert torch.equal(got[3][spare], case["snapshot_conv"][spare])
    assert torch.equal(got[4][spare], case["snapshot_recurrent"][spare])


# Snapshot tables that break the contract, each with one good sequence beside the bad entry:
# per sequence (points, rows); None rows: distinct valid rows. Pools have 6 rows.
BAD_SNAPSHOTS = {
    "not_a_chunk_boundary": [[64], [3], []],
    "past_the_sequence": [[64, 256], [], []],
    "not_increasing": [[128, 64], [], []],
    "repeated": [[64, 64], [], []],
    "point_after_none": [[64], [-1, 5], []],
    "negative": [[64], [-5], []],
    "zero": [[0], [], []],
    "row_past_the_pool": ([[64], [70], []], [[0], [6], []]),
    "negative_row": ([[64], [70], []], [[0], [-1], []]),
}


@pytest.mark.parametrize("lower_bound", [-5.0, 0.0], ids=["chunked", "softplus"])
@pytest.mark.parametrize("bad", list(BAD_SNAPSHOTS))
def test_bad_snapshot_points_write_nothing(bad, lower_bound):
    """A step with a snapshot entry that breaks the contract: the kernels write no snapshot at all
    (pools bit-identical, the good sequence's rows too), the outputs and states are those of a run
    without snapshots, and the binding reports the verdict by name; the next good call is clean."""
    spec = BAD_SNAPSHOTS[bad]
    points, rows = spec if isinstance(spec, tuple) else (spec, None)
    case = snapshot_case([200, 70, 5], [1, 0, 1], points, 4, 64, lower_bound, seed=41, rows=rows,
                         spare=6 - sum(o != -1 for p in points for o in p))
    assert case["snapshot_conv"].shape[0] == 6
    plain = run(PREFILL, dict(case, snapshot_offsets=torch.full_like(case["snapshot_offsets"], -1)), "cuda")
    kda_kernels.check_snapshot_verdicts()
    with pytest.raises(ValueError, match=r"kda_prefill.*snapshot_offsets / snapshot_rows"):
        got = run(PREFILL, case, "cuda", snapshots=True)
        kda_kernels.check_snapshot_verdicts()
    for a, b in zip(plain, got):
        assert torch.equal(a, b), f"{bad}: the output or the final states differ from a run without snapshots"
    assert torch.equal(got[3], case["snapshot_conv"]), f"{bad}: a snapshot conv row was written"
    assert torch.equal(got[4], case["snapshot_recurrent"]), f"{bad}: a snapshot state row was written"
    with pytest.raises(ValueError, match="snapshot_(offsets|rows)"):  # the reference refuses the same table
        run(PREFILL, case, "cpu", snapshots=True)
    good = snapshot_case([200, 70, 5], [1, 0, 1], [[64, 200], [70], [5]], 4, 64, lower_bound, seed=41)
    run(PREFILL, good, "cuda", snapshots=True)
    kda_kernels.check_snapshot_verdicts()


REFUSED = r"kda_prefill.*snapshot_offsets / snapshot_rows"


def _bad_table_case():
    """A prefill whose snapshot table the kernels refuse (a point at 0) and its inputs on the device."""
    case = snapshot_case([200, 70, 5], [1, 0, 1], BAD_SNAPSHOTS["zero"], 4, 64, -5.0, seed=43, spare=5)
    return case, {k: case[k].clone().cuda() for k in ARG_ORDER}


def test_a_full_ring_keeps_the_verdict_of_the_call_that_raised():
    """With the device held back (a sleep kernel) the host queues a ring's worth of prefills ahead of
    their verdicts, the first with a refused table: the next launch waits for the oldest, raises its
    refusal, and still queues its own (refused too), which the final check raises in turn."""
    kda_kernels.check_snapshot_verdicts()
    case, tensors = _bad_table_case()
    ring = kda_kernels.verdicts.ring(tensors["qkv"].device)
    # every call its own table tensors, so that each queues a verdict
    bad = tensors["snapshot_offsets"]
    tables = [bad.clone()] + [torch.full_like(bad, -1) for _ in range(ring.SIZE - 1)] + [bad.clone()]

    def launch(offsets):
        PREFILL(*(offsets if k == "snapshot_offsets" else tensors[k] for k in ARG_ORDER), *case["attrs"])
    launch(torch.full_like(bad, -1))  # a good call first: the ring's words and events exist before the sleep
    kda_kernels.check_snapshot_verdicts()
    torch.cuda.synchronize()
    torch.cuda._sleep(2_000_000_000)  # about a second: no verdict lands while the host queues
    for offsets in tables[:-1]:
        launch(offsets)
    assert ring.count == ring.SIZE
    with pytest.raises(ValueError, match=REFUSED):
        launch(tables[-1])
    assert ring.count == ring.SIZE, "the call that raised lost its own verdict"
    with pytest.raises(ValueError, match=REFUSED):
        kda_kernels.check_snapshot_verdicts()
    kda_kernels.check_snapshot_verdicts()
    assert ring.count == 0


def test_verdicts_are_read_per_device():
    """A check of another device neither waits for nor raises this device's verdict; every spelling
    of this device reads it. With two GPUs, a refusal on the second is the second's alone."""
    kda_kernels.check_snapshot_verdicts()
    case, tensors = _bad_table_case()
    PREFILL(*(tensors[k] for k in ARG_ORDER), *case["attrs"])
    torch.cuda.synchronize()
    here = torch.cuda.current_device()
    kda_kernels.check_snapshot_verdicts(device="cpu")
    assert kda_kernels.verdicts.ring(torch.device("cuda")).count == 1
    with pytest.raises(ValueError, match=REFUSED):
        kda_kernels.check_snapshot_verdicts(device=f"cuda:{here}")
    if torch.cuda.device_count() > 1:
        other = (here + 1) % torch.cuda.device_count()
        with torch.cuda.device(other):
            on_other = {k: t.to(f"cuda:{other}") for k, t in tensors.items()}
            PREFILL(*(on_other[k] for k in ARG_ORDER), *case["attrs"])
        torch.cuda.synchronize(other)
        kda_kernels.check_snapshot_verdicts(device=f"cuda:{here}")
        with pytest.raises(ValueError, match=REFUSED):
            kda_kernels.check_snapshot_verdicts(device=f"cuda:{other}")
    kda_kernels.check_snapshot_verdicts()


def test_capture_is_judged_on_the_tensors_device():
    """``ops/capture.capturing`` (what step.py and this binding ask before event queries and the
    packed step copy): true on the capturing device, false outside, false for another device."""
    from k3_trtllm.ops.capture import capturing
    here = torch.device("cuda", torch.cuda.current_device())
    others = [torch.device("cuda", i) for i in range(torch.cuda.device_count()) if i != here.index]
    x = torch.zeros(8, device=here)
    graph, seen = torch.cuda.CUDAGraph(), {}
    with torch.cuda.graph(graph):
        x += 1
        seen = {"here": capturing(here), "plain": capturing(torch.device("cuda")),
                "others": [capturing(d) for d in others], "cpu": capturing(torch.device("cpu"))}
    assert seen == {"here": True, "plain": True, "others": [False] * len(others), "cpu": False}
    assert not capturing(here)


def test_the_executor_raises_a_refused_table_from_its_step():
    """The torch executor waits for a step's verdicts when the step took snapshots: a refused table
    raises its ValueError from that step's ``execute`` (no hang, no later call needed), and a good
    run through the engine leaves the device's ring empty."""
    from pathlib import Path

    from k3_trtllm.model import build_step
    from k3_trtllm.runtime.engine import build_engine
    from k3_trtllm.runtime.sequence import SamplingParams
    kda_kernels.check_snapshot_verdicts()
    tiny = Path(__file__).resolve().parents[2] / "examples" / "tiny-k3"
    engine = build_engine(str(tiny), dtype=torch.bfloat16, device="cuda", block_size=16, num_blocks=64,
                          max_slots=4, max_batch_size=4, max_num_tokens=256, max_seq_len=128, prefix_cache=True,
                          prefix_cache_interval=16, snapshot_slots=16)
    executor = engine.runner.executor
    engine.generate([list(range(3, 43)), list(range(5, 30))],
                    SamplingParams(max_new_tokens=3, temperature=0.0, ignore_eos=True))
    assert kda_kernels.verdicts.ring(executor.device).count == 0
    bad = build_step([(list(range(3, 43)), 0, 0, [0, 1, 2])], 16, snapshots=[[(0, 0)]])
    with pytest.raises(ValueError, match=REFUSED):
        executor.execute(bad, False)
    assert kda_kernels.verdicts.ring(executor.device).count == 0
