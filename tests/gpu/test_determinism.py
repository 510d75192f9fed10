"""Reproducible GPU outputs (issue 23): the same op call or model step, run again on the same
inputs and caches, gives the same bits; a CUDA-graph replay of a decode step gives the bits of
the eager step.

- The SiTU MoE op (the one kernel family that accumulated across CTAs: fp32 atomics per routed
  expert, whose order varied, until the combine became per-(token, slot) partials summed in
  slot order) at one K3 EP rank's real dims (112 local experts, top-16, latent 3584, I 3072),
  bf16 and MXFP4 experts, T = 1, 8, 64 (decode GEMMs), 1024 (warpgroup-MMA prefill GEMMs), an EP
  shard whose tokens also route elsewhere, and sizes that take the mma.sync prefill GEMMs:
  each call repeated and compared bitwise with the first.
- The shipped tiny K3 (MLA, KDA and MXFP4 MoE kernels, torch GEMMs and norms): a prefill step,
  a decode step and a mixed prefill/decode step at batch 1, 8 and 64, each run twice from
  copies of the same caches: logits and every cache tensor bitwise equal.
- A decode step captured with torch.cuda.CUDAGraph and replayed: logits and caches equal to
  the eager step's bitwise.
- The MoE op's batch-invariant mode (kernels chosen by sizes, not token count): each of 16
  tokens run alone, and the 16 as a batch, equal their rows of a 300-token call bitwise.
- The MLA kernels' batch-invariant mode (split-KV at fixed key multiples, absorbed prefill):
  each sequence of a mixed-context batch run alone equals its rows of the batched call bitwise.
- The whole batch-invariant mode (ops/batch_invariant.py): 16 prompts prefilled in one step
  and decoded greedily together give, step by step, the logits (bitwise) and tokens of each
  prompt run alone.

"Bitwise" compares the raw bits (int views), so -0.0 vs 0.0 or two NaN payloads would count as
different. Skipped without CUDA or without the kernel library.
"""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from k3_trtllm.ops.cuda_library import library_path

ROOT = Path(__file__).resolve().parents[2]
TINY = ROOT / "examples" / "tiny-k3"
BS = 16
REPEATS = 8

pytestmark = [
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
    pytest.mark.skipif(not library_path().exists(), reason=f"kernel library {library_path()} not built"),
]

_INT_VIEW = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def bits_differ(a: torch.Tensor, b: torch.Tensor) -> str | None:
    """None when a and b hold the same bits, else how far apart they are."""
    assert a.shape == b.shape and a.dtype == b.dtype, (a.shape, a.dtype, b.shape, b.dtype)
    if not a.dtype.is_floating_point:
        return None if torch.equal(a, b) else f"{int((a != b).sum())} elements differ"
    view = _INT_VIEW[a.element_size()]
    ne = a.contiguous().view(view) != b.contiguous().view(view)
    if not ne.any():
        return None
    diff = (a.double() - b.double()).abs()
    return f"{int(ne.sum())} of {a.numel()} elements differ, max |diff| {float(diff.max()):.3g}"


# ---------------------------------------------------------------------------------------------
# The MoE op
# (num_experts, local experts, expert_offset, top_k, L, I, D)
K3_RANK = (112, 112, 0, 16, 3584, 3072, 7168)  # one EP rank after the all-to-all
K3_EP_SHARD = (896, 112, 224, 16, 3584, 3072, 7168)  # EP8 rank 2 before it: most slots elsewhere
MMA_SYNC = (64, 64, 0, 8, 320, 192, 256)  # L % 256 != 0: the mma.sync prefill GEMMs


def moe_inputs(case, T, mxfp4, seed):
    E, El, _, _, L, I, D = case
    g = torch.Generator(device="cuda").manual_seed(seed)
    rnd = lambda *s, k=1.0: torch.randn(*s, generator=g, device="cuda") * k  # noqa: E731
    x, z = rnd(T, D).bfloat16(), rnd(T, L).bfloat16()
    router, bias = rnd(E, D, k=D ** -0.5), rnd(E, k=0.1)
    if not mxfp4:
        return [x, z, router, bias, rnd(El, 2 * I, L, k=L ** -0.5).bfloat16(), rnd(El, L, I, k=I ** -0.5).bfloat16()]
    out = [x, z, router, bias]
    for rows, cols in ((2 * I, L), (L, I)):  # random codes, scale bytes around 2^-6 (gate/up O(1))
        out.append(torch.randint(0, 256, (El, rows, cols // 2), generator=g, device="cuda", dtype=torch.uint8))
        out.append(torch.randint(119, 123, (El, rows, cols // 32), generator=g, device="cuda", dtype=torch.uint8))
    return out


@pytest.fixture(scope="module")
def cuda_moe():
    from k3_trtllm.ops.moe import cuda as moe  # registers the CUDA kernels
    return moe


@pytest.mark.parametrize("mxfp4", [False, True], ids=["bf16", "mxfp4"])
@pytest.mark.parametrize("case, T", [(K3_RANK, 1), (K3_RANK, 8), (K3_RANK, 64), (K3_RANK, 1024),
                                     (K3_EP_SHARD, 64), (K3_EP_SHARD, 1024), (MMA_SYNC, 1024)],
                         ids=["rank-T1", "rank-T8", "rank-T64", "rank-T1024", "shard-T64", "shard-T1024",
                              "mma_sync-T1024"])
def test_moe_op_repeats_bitwise(cuda_moe, case, T, mxfp4):
    E, El, off, k = case[:4]
    attrs = (E, k, 1, 1, off, 0, 1, 1.0, 1, 2.0, 4.0)
    args = moe_inputs(case, T, mxfp4, seed=T)
    op = torch.ops.k3.situ_moe_mxfp4 if mxfp4 else torch.ops.k3.situ_moe
    first = op(*args, *attrs)
    assert first.abs().sum() > 0 and torch.isfinite(first.float()).all()
    for i in range(REPEATS):
        d = bits_differ(op(*args, *attrs), first)
        assert d is None, f"call {i + 1} differs from the first: {d}"


@pytest.fixture
def batch_invariant(cuda_moe):
    previous = cuda_moe.set_batch_invariant(True)
    yield
    cuda_moe.set_batch_invariant(previous)


@pytest.mark.parametrize("mxfp4", [False, True], ids=["bf16", "mxfp4"])
@pytest.mark.parametrize("case", [K3_RANK, K3_EP_SHARD, MMA_SYNC], ids=["rank", "shard", "mma_sync"])
def test_moe_batch_invariant_mode_each_token_alone_equals_batched(cuda_moe, batch_invariant, case, mxfp4):
    """Under the MoE batch-invariant mode, 16 tokens run alone, and as a batch of 16, give the
    bits they get inside a 300-token (prefill-sized) call."""
    E, El, off, k = case[:4]
    attrs = (E, k, 1, 1, off, 0, 1, 1.0, 1, 2.0, 4.0)
    args = moe_inputs(case, 300, mxfp4, seed=11)
    op = torch.ops.k3.situ_moe_mxfp4 if mxfp4 else torch.ops.k3.situ_moe
    x, z, rest = args[0], args[1], args[2:]
    full = op(x, z, *rest, *attrs)
    assert full.abs().sum() > 0
    d = bits_differ(op(x[:16].clone(), z[:16].clone(), *rest, *attrs), full[:16])
    assert d is None, f"16 tokens batched vs inside 300: {d}"
    for t in range(16):
        d = bits_differ(op(x[t:t + 1].clone(), z[t:t + 1].clone(), *rest, *attrs), full[t:t + 1])
        assert d is None, f"token {t} alone vs inside 300: {d}"


MLA_K3 = dict(nope=128, rope=64, rank=512, v=128)
MLA_TINY = dict(nope=32, rope=16, rank=64, v=32)


def mla_batch(heads, dims, contexts, new, block_size=64, seed=0):
    """Sequences with their own consecutive cache blocks, random bf16 data."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    rnd = lambda *s: torch.randn(*s, generator=g, device="cuda")  # noqa: E731
    width = dims["rank"] + dims["rope"]
    blocks = [max(1, -(-(c + n) // block_size)) for c, n in zip(contexts, new)]
    tables = torch.zeros(len(contexts), max(blocks), dtype=torch.int32, device="cuda")
    first = 0
    for b, nb in enumerate(blocks):
        tables[b, :nb] = torch.arange(first, first + nb, dtype=torch.int32)
        first += nb
    slots = []
    for b, (c, n) in enumerate(zip(contexts, new)):
        pos = torch.arange(c, c + n, device="cuda")
        slots.append(tables[b, pos // block_size].long() * block_size + pos % block_size)
    slots = torch.cat(slots)
    T = sum(new)
    bf = torch.bfloat16
    return dict(q=rnd(T, heads, dims["nope"] + dims["rope"]).to(bf), latent=rnd(T, width).to(bf),
                w_uk=(rnd(heads, dims["nope"], dims["rank"]) / dims["nope"] ** 0.5).to(bf),
                w_uv=(rnd(heads, dims["v"], dims["rank"]) / dims["rank"] ** 0.5).to(bf),
                cu=torch.tensor([0] + torch.tensor(new).cumsum(0).tolist(), dtype=torch.int32, device="cuda"),
                ctx=torch.tensor(contexts, dtype=torch.int32, device="cuda"), tables=tables,
                slots=slots.to(torch.int32), cache=rnd(first, block_size, width).to(bf), blocks=blocks, new=new)


def mla_call(fn, s, heads, dims, rows=None):
    """fn on the whole batch, or on the sequences `rows` alone (their own block-table width)."""
    if rows is None:
        q, lat, cu, ctx, tables, slots = s["q"], s["latent"], s["cu"], s["ctx"], s["tables"], s["slots"]
    else:
        b = rows
        t0, t1 = int(s["cu"][b]), int(s["cu"][b + 1])
        # fresh (aligned) tensors: slices start mid-allocation, which the kernels refuse
        q, lat, slots = s["q"][t0:t1].clone(), s["latent"][t0:t1].clone(), s["slots"][t0:t1].clone()
        cu = torch.tensor([0, t1 - t0], dtype=torch.int32, device="cuda")
        ctx, tables = s["ctx"][b:b + 1].clone(), s["tables"][b:b + 1, :s["blocks"][b]].clone()
    cache = s["cache"].clone()
    scale = (dims["nope"] + dims["rope"]) ** -0.5
    out = fn(q, lat, s["w_uk"], s["w_uv"], cu, ctx, tables, slots, cache, heads,
             dims["nope"], dims["rope"], dims["rank"], dims["v"], scale)
    return out, cache


@pytest.mark.filterwarnings("error::k3_trtllm.ops.cuda_library.KernelFallbackWarning")  # the kernels must run
@pytest.mark.parametrize("form", ["decode", "prefill"])
@pytest.mark.parametrize("heads, dims", [(12, MLA_K3), (96, MLA_K3), (4, MLA_TINY)], ids=["k3-12h", "k3-96h", "tiny"])
def test_mla_batch_invariant_mode_each_sequence_alone_equals_batched(cuda_moe, heads, dims, form):
    """Under the batch-invariant mode, each sequence of a batch (contexts up to 9000 keys, so
    the long ones take many splits while alone the short ones take one) run alone gives its
    rows of the batched call bitwise, and writes the same latent rows."""
    from k3_trtllm.ops.mla import cuda as cuda_mla
    from k3_trtllm.ops.batch_invariant import set_batch_invariant
    contexts = [0, 5, 300, 1000, 3000, 9000]
    new = [1] * 6 if form == "decode" else [40, 1, 300, 77, 1, 130]
    fn = cuda_mla.mla_decode_cuda if form == "decode" else cuda_mla.mla_prefill_cuda
    s = mla_batch(heads, dims, contexts, new, seed=heads)
    set_batch_invariant(True)
    try:
        out, cache = mla_call(fn, s, heads, dims)
        for b in range(len(contexts)):
            alone, alone_cache = mla_call(fn, s, heads, dims, rows=b)
            t0, t1 = int(s["cu"][b]), int(s["cu"][b + 1])
            d = bits_differ(alone, out[t0:t1])
            assert d is None, f"sequence {b} (context {contexts[b]}, {new[b]} new): alone vs batched {d}"
            rows = s["slots"][t0:t1].long()
            flat, flat_alone = cache.view(-1, cache.shape[-1]), alone_cache.view(-1, cache.shape[-1])
            assert bits_differ(flat_alone[rows], flat[rows]) is None
    finally:
        set_batch_invariant(False)


# ---------------------------------------------------------------------------------------------
# Whole tiny-k3 steps
@pytest.fixture(scope="module")
def model():
    from k3_trtllm.model import load_model
    return load_model(TINY, dtype=torch.bfloat16, device="cuda")


def clone_caches(c):
    from k3_trtllm.model.caches import K3Caches
    return K3Caches({i: t.clone() for i, t in c.latent.items()}, {i: t.clone() for i, t in c.conv.items()},
                    {i: t.clone() for i, t in c.recurrent.items()}, c.block_size)


def cache_tensors(c):
    for kind in ("latent", "conv", "recurrent"):
        for i, t in sorted(getattr(c, kind).items()):
            yield f"{kind}[{i}]", t


def assert_same(logits_a, caches_a, logits_b, caches_b, what):
    d = bits_differ(logits_a, logits_b)
    assert d is None, f"{what}: logits {d}"
    for (name, a), (_, b) in zip(cache_tensors(caches_a), cache_tensors(caches_b)):
        d = bits_differ(a, b)
        assert d is None, f"{what}: cache {name} {d}"


class Batch:
    """B sequences with prompts of 1..40 tokens, each with its own blocks and state slot."""

    def __init__(self, model, B: int, seed: int = 0):
        g = torch.Generator().manual_seed(seed)
        self.lengths = torch.randint(1, 41, (B,), generator=g).tolist()
        self.tokens = [torch.randint(3, 1024, (n + 16,), generator=g).tolist() for n in self.lengths]
        blocks = [(n + 16 + BS - 1) // BS for n in self.lengths]
        first = [sum(blocks[:i]) for i in range(B)]
        self.tables = [list(range(f, f + b)) for f, b in zip(first, blocks)]
        self.done = [0] * B  # tokens already in the caches
        self.caches = model.allocate_caches(sum(blocks), BS, B)

    def step(self, new: list[int]):
        """A step giving sequence i its next new[i] tokens (0 = not in this step)."""
        from k3_trtllm.model import build_step
        seqs = [(self.tokens[i][self.done[i]:self.done[i] + n], self.done[i], i, self.tables[i])
                for i, n in enumerate(new) if n > 0]
        return build_step(seqs, BS).to("cuda"), new

    def advance(self, new: list[int]):
        self.done = [d + n for d, n in zip(self.done, new)]


def run_twice(model, batch: Batch, new: list[int], what: str, decode: bool | None = None):
    """The step twice from copies of the same caches; bitwise checks; then the batch's own
    caches advance by that step."""
    step, _ = batch.step(new)
    a, b = clone_caches(batch.caches), clone_caches(batch.caches)
    logits_a = model(step, a, decode)
    logits_b = model(step, b, decode)
    torch.cuda.synchronize()
    assert torch.isfinite(logits_a.float()).all()
    assert_same(logits_a, a, logits_b, b, what)
    batch.caches = a
    batch.advance(new)


@pytest.mark.parametrize("B", [1, 8, 64])
def test_tiny_k3_steps_repeat_bitwise(model, B):
    batch = Batch(model, B, seed=B)
    run_twice(model, batch, batch.lengths, f"B={B} prefill")
    run_twice(model, batch, [1] * B, f"B={B} decode", decode=True)
    # Mixed: the even sequences decode one token, the odd ones prefill a chunk of 2..9 tokens.
    mixed = [1 if i % 2 == 0 else 2 + i % 8 for i in range(B)]
    run_twice(model, batch, mixed, f"B={B} mixed prefill/decode")


@pytest.mark.parametrize("B", [1, 8, 64])
def test_cuda_graph_decode_replay_equals_eager(model, B):
    batch = Batch(model, B, seed=100 + B)
    run_twice(model, batch, batch.lengths, f"B={B} prefill")
    step, _ = batch.step([1] * B)
    eager_caches = clone_caches(batch.caches)
    eager = model(step, eager_caches, True)

    graph_caches = clone_caches(batch.caches)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up (lazy handles, kernel attributes) on scratch caches
        model(step, clone_caches(batch.caches), True)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_logits = model(step, graph_caches, True)
    for replay in range(2):
        for (_, dst), (_, src) in zip(cache_tensors(graph_caches), cache_tensors(batch.caches)):
            dst.copy_(src)  # the same starting caches as the eager step
        graph.replay()
        torch.cuda.synchronize()
        assert_same(static_logits, graph_caches, eager, eager_caches, f"B={B} graph replay {replay + 1} vs eager")


def generate(model, prompts: list[list[int]], steps: int) -> tuple[list[list[int]], list[torch.Tensor]]:
    """Greedy decoding of the prompts as one batch: one prefill step of all of them, then
    `steps` decode steps. Returns each prompt's generated tokens and the logits of every step."""
    from k3_trtllm.model import build_step
    blocks = [(len(p) + steps + BS - 1) // BS for p in prompts]
    first = [sum(blocks[:i]) for i in range(len(prompts))]
    tables = [list(range(f, f + b)) for f, b in zip(first, blocks)]
    caches = model.allocate_caches(sum(blocks), BS, len(prompts))
    seqs = [(p, 0, i, t) for i, (p, t) in enumerate(zip(prompts, tables))]
    out, all_logits = [[] for _ in prompts], []
    for s in range(steps + 1):
        logits = model(build_step(seqs, BS).to("cuda"), caches, s > 0)
        all_logits.append(logits.float().cpu())
        nxt = logits.float().argmax(-1).tolist()
        for i, tok in enumerate(nxt):
            out[i].append(tok)
        seqs = [([nxt[i]], len(prompts[i]) + s, i, tables[i]) for i in range(len(prompts))]
    return out, all_logits


def test_batch_invariant_mode_16_prompts_batched_equal_each_alone(model):
    from k3_trtllm.ops.batch_invariant import set_batch_invariant
    g = torch.Generator().manual_seed(23)
    lengths = torch.randint(1, 60, (16,), generator=g).tolist()
    prompts = [torch.randint(3, 1024, (n,), generator=g).tolist() for n in lengths]
    steps = 8
    set_batch_invariant(True)
    try:
        tokens, logits = generate(model, prompts, steps)
        for i, p in enumerate(prompts):
            alone_tokens, alone_logits = generate(model, [p], steps)
            for s in range(steps + 1):
                d = bits_differ(alone_logits[s][0], logits[s][i])
                assert d is None, f"prompt {i} ({len(p)} tokens), step {s}: alone vs batched logits {d}"
            assert alone_tokens[0] == tokens[i]
    finally:
        set_batch_invariant(False)
    # Without the mode the same comparison usually differs (recorded, not asserted: whether it
    # does depends on the data).
    tokens_default, logits_default = generate(model, prompts, steps)
    differing = sum(bits_differ(generate(model, [p], steps)[1][0][0], logits_default[0][i]) is not None
                    for i, p in enumerate(prompts))
    print(f"default mode: {differing} of 16 prompts' prefill logits differ alone vs batched")
