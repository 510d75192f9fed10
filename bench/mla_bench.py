"""MLA kernels on the GPU: decode (absorbed, paged) and prefill, against FlashMLA and torch.

    python bench/mla_bench.py --out DIR [--flashmla path/_flashmla_C.abi3.so]
        [--shapes 64x8192x12,256x8192x16] [--attn-only] [--skip-prefill] [--skip-decode] [--no-plot]
    python bench/mla_bench.py --out DIR --fp8-cache [--commit ID] [--fp8-shapes 1x8192x12,...]

Writes DIR/mla_h200.json and DIR/mla_h200.png (--shapes: decode B x L x H to run;
--attn-only: time the attention part alone, without whole-decode and torch rows). The
attention part is timed twice: back-to-back calls between events (host launch overhead
partly hidden) and replays of a CUDA graph of 8 calls (GPU time alone, `*_graph_*` keys).
Prefill: single sequences of T new tokens (the op as dispatched, the absorbed form on the
same inputs, torch SDPA on expanded keys with and without the expansion), attention
TFLOP/s counting the causal half, T(T+1)/2 query-key pairs x H x 2(Dqk+Dv); and chunks of
n new tokens after a cached context (expanded vs absorbed form: where the dispatch rule's
384 tokens per sequence sits).
Decode bandwidth counts the latent cache bytes that must be read once (B * L * (R+Dr) * 2),
over the time of the attention part alone (FlashMLA's scope: q_lat in, a_lat out) and of
the whole decode op (cache insert, q_nope·W_UK, attention, ·W_UV), as TB/s and as a
fraction of a device-to-device copy measured in the same run. Small caches rotate over copies so that L2 does not serve them.
--fp8-cache: only the attention part at the fp8 shapes (contexts 8k and 32k, batch 1/8/64, 12
and 128 heads) over the bf16 cache (ours, FlashMLA) and the fp8 cache (ours; rows of 656
bytes instead of 1152), GPU time (CUDA graphs), each against its bytes-read floor (the cache
bytes over the copy bandwidth) -> DIR/mla_fp8_cache_h200.json.
--issue21: every MLA row of issue 21 in one process, each with its peer measured beside it:
decode attention at 96/128 heads (B >= 64) and B 1 / 32k / 128 heads against FlashMLA, 12-16 heads
as a fraction of copy, prefill at T=16384 against SDPA, the fp8 cache against the bf16 one at
8k and 32k -> DIR/mla_issue21_h200.json (commit, GPU, the library, each goal with its value).
"""
from __future__ import annotations

import argparse
import datetime
import hashlib
import json
import math
import os
import statistics
import subprocess
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run as `python bench/mla_bench.py` without PYTHONPATH
from k3_trtllm.ops.mla import cuda as cuda_mla  # noqa: E402

SOURCES = sorted([*ROOT.glob("plugins/include/k3/mla/*.cuh"), ROOT / "plugins/c_api/mla.cu",
                  ROOT / "k3_trtllm/ops/mla/cuda.py", ROOT / "bench/mla_bench.py"])
NOPE, ROPE, RANK, VDIM = 128, 64, 512, 128
WIDTH = RANK + ROPE
SCALE = (NOPE + ROPE) ** -0.5
BLOCK = 64
DECODE_SHAPES = [(64, 8192, 96), (64, 8192, 12), (256, 8192, 16), (1, 32768, 128), (128, 2048, 128)]
PREFILL_T = [2048, 16384]
PREFILL_HEADS = [96, 12]
CHUNK_CONTEXT = 16384
CHUNK_NEW = [128, 384, 1024]
FP8_SHAPES = [(b, L, h) for L in (8192, 32768) for h in (12, 128) for b in (1, 8, 64)]
FP8_GROUP = 128  # fp8_cache.scale_group_for(512)
ISSUE21_DECODE = [(64, 8192, 96), (64, 8192, 128), (128, 2048, 128), (1, 32768, 128), (64, 8192, 12),
                  (256, 8192, 16)]
ISSUE21_PREFILL = [(16384, 96), (16384, 12)]  # (new tokens, heads)
ISSUE21_FP8 = [(64, 8192, 12), (64, 32768, 12), (64, 8192, 128), (64, 32768, 128)]


def time_ms(fn, reps=20, warmup=3, batch=8):
    """Median over reps of device-event timings of `batch` back-to-back calls, per call:
    the queue stays full, so host-side launch overhead (Python, ctypes, allocations) is
    hidden behind the previous call's kernels as it is in a real decode step.
    fn(i) gets the call index (for rotation)."""
    for i in range(warmup):
        fn(i)
    torch.cuda.synchronize()
    times = []
    for i in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for k in range(batch):
            fn(i * batch + k)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / batch)
    return statistics.median(times)


def time_graph_ms(fn, reps=20, batch=8):
    """GPU time alone: `batch` calls captured in one CUDA graph (as a serving engine runs
    decode), replayed between two events; median over reps, per call. fn(i) as in time_ms."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up off the capture stream (allocations, metadata)
        for i in range(batch):
            fn(i)
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(batch):
            fn(i)
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / batch)
    return statistics.median(times)


def copy_bandwidth():
    n = 2 << 30
    src = torch.empty(n, dtype=torch.uint8, device="cuda").random_()
    dst = torch.empty_like(src)
    ms = time_ms(lambda i: dst.copy_(src), reps=10, batch=2)
    return 2 * n / ms / 1e9  # TB/s (read + write)


def rel_err(a, b):
    a, b = a.float(), b.float()
    return ((a - b).norm() / b.norm()).item()


def decode_case(batch, length, heads, copy_tbps, flashmla, attn_only=False):
    gen = torch.Generator(device="cuda").manual_seed(batch * 7 + heads)
    blocks_per_seq = length // BLOCK
    num_blocks = batch * blocks_per_seq
    cache_bytes = num_blocks * BLOCK * WIDTH * 2
    copies = max(1, math.ceil((256 << 20) / cache_bytes))
    caches = [torch.randn(num_blocks, BLOCK, WIDTH, generator=gen, device="cuda").to(torch.bfloat16)
              for _ in range(copies)]
    block_tables = torch.randperm(num_blocks, generator=gen, device="cuda").to(torch.int32).view(batch, -1)
    context = torch.full((batch,), length - 1, dtype=torch.int32, device="cuda")
    cu = torch.arange(batch + 1, dtype=torch.int32, device="cuda")
    last = length - 1
    slots = (block_tables[:, last // BLOCK].long() * BLOCK + last % BLOCK).to(torch.int32)
    q = torch.randn(batch, heads, NOPE + ROPE, generator=gen, device="cuda").to(torch.bfloat16)
    latent = torch.randn(batch, WIDTH, generator=gen, device="cuda").to(torch.bfloat16)
    w_uk = (torch.randn(heads, NOPE, RANK, generator=gen, device="cuda") / NOPE ** 0.5).to(torch.bfloat16)
    w_uv = (torch.randn(heads, VDIM, RANK, generator=gen, device="cuda") / RANK ** 0.5).to(torch.bfloat16)
    q_lat = torch.einsum("bhd,hdr->bhr", q[..., :NOPE], w_uk).contiguous()
    attrs = (heads, NOPE, ROPE, RANK, VDIM, SCALE)
    latent_bytes = batch * length * WIDTH * 2
    row = dict(batch=batch, context=length, heads=heads, latent_bytes=latent_bytes, l2_rotation_copies=copies)

    def ours_attn(i):
        return cuda_mla.latent_attention(q_lat, q, cu, context, block_tables, caches[i % copies], NOPE, SCALE)

    def ours_whole(i):
        return cuda_mla.mla_decode_cuda(q, latent, w_uk, w_uv, cu, context, block_tables, slots,
                                        caches[i % copies], *attrs)

    slot_index = (block_tables.long()[:, :, None] * BLOCK + torch.arange(BLOCK, device="cuda")).view(batch, -1)

    def eager_attn(i, ql=None):
        kv = caches[i % copies].view(-1, WIDTH)[slot_index]  # [B, L, 576]
        query = torch.cat([q_lat if ql is None else ql, q[..., NOPE:]], dim=-1)
        scores = torch.bmm(query, kv.transpose(1, 2)).float() * SCALE
        probs = torch.softmax(scores, dim=-1).to(torch.bfloat16)
        return torch.bmm(probs, kv[..., :RANK])

    def eager_whole(i):
        caches[i % copies].view(-1, WIDTH)[slots.long()] = latent
        ql = torch.einsum("bhd,hdr->bhr", q[..., :NOPE], w_uk)
        a = eager_attn(i, ql)
        return torch.einsum("bhr,hvr->bhv", a, w_uv).reshape(batch, -1)

    want = eager_attn(0)
    row["ours_vs_eager_rel_err"] = rel_err(ours_attn(0), want)
    timings = {"ours_attn": time_ms(ours_attn)}
    try:
        timings["ours_attn_graph"] = time_graph_ms(ours_attn)
    except Exception as exc:  # keep the event timings if capture fails
        row["graph_error"] = repr(exc)[:300]
    if not attn_only:
        timings.update(ours_whole=time_ms(ours_whole), eager_attn=time_ms(eager_attn, reps=5, batch=1),
                       eager_whole=time_ms(eager_whole, reps=5, batch=1))

    if flashmla:
        q_cat = torch.cat([q_lat, q[..., NOPE:]], dim=-1).view(batch, 1, heads, WIDTH)
        seqlens = torch.full((batch,), length, dtype=torch.int32, device="cuda")
        state = {}

        def fm_attn(i, query=q_cat):
            out, _, meta, splits = torch.ops._flashmla_C.dense_decode_fwd(
                query, caches[i % copies].view(num_blocks, BLOCK, 1, WIDTH), RANK, seqlens, block_tables,
                SCALE, False, state.get("meta"), state.get("splits"), None)
            state["meta"], state["splits"] = meta, splits
            return out

        def fm_whole(i):
            caches[i % copies].view(-1, WIDTH)[slots.long()] = latent
            ql = torch.einsum("bhd,hdr->bhr", q[..., :NOPE], w_uk)
            out = fm_attn(i, torch.cat([ql, q[..., NOPE:]], dim=-1).view(batch, 1, heads, WIDTH))
            return torch.einsum("bhr,hvr->bhv", out.view(batch, heads, RANK), w_uv).reshape(batch, -1)

        try:
            row["flashmla_vs_eager_rel_err"] = rel_err(fm_attn(0).view(batch, heads, RANK), want)
            timings["flashmla_attn"] = time_ms(fm_attn)
            timings["flashmla_attn_graph"] = time_graph_ms(fm_attn)
            if not attn_only:
                timings["flashmla_whole"] = time_ms(fm_whole)
        except Exception as exc:  # record why the peer did not run, keep our numbers
            row["flashmla_error"] = repr(exc)[:300]

    for name, ms in timings.items():
        row[f"{name}_us"] = ms * 1e3
        row[f"{name}_tbps"] = latent_bytes / ms / 1e9
        row[f"{name}_copy_frac"] = row[f"{name}_tbps"] / copy_tbps
    return row


def fp8_decode_case(batch, length, heads, copy_tbps, flashmla):
    """Attention alone over the same random latents as a bf16 cache and as an fp8 one."""
    from k3_trtllm.ops.mla import fp8_cache
    gen = torch.Generator(device="cuda").manual_seed(batch * 7 + heads)
    blocks_per_seq = length // BLOCK
    num_blocks = batch * blocks_per_seq
    row_bytes = fp8_cache.row_bytes(RANK, ROPE, FP8_GROUP)
    bf16_bytes, fp8_bytes = batch * length * WIDTH * 2, batch * length * row_bytes
    copies = max(1, math.ceil((256 << 20) / bf16_bytes))
    caches = [torch.randn(num_blocks, BLOCK, WIDTH, generator=gen, device="cuda").to(torch.bfloat16)
              for _ in range(copies)]
    caches8 = [fp8_cache.quantize(c, RANK, FP8_GROUP) for c in caches]
    block_tables = torch.randperm(num_blocks, generator=gen, device="cuda").to(torch.int32).view(batch, -1)
    context = torch.full((batch,), length - 1, dtype=torch.int32, device="cuda")
    cu = torch.arange(batch + 1, dtype=torch.int32, device="cuda")
    q = torch.randn(batch, heads, NOPE + ROPE, generator=gen, device="cuda").to(torch.bfloat16)
    w_uk = (torch.randn(heads, NOPE, RANK, generator=gen, device="cuda") / NOPE ** 0.5).to(torch.bfloat16)
    q_lat = torch.einsum("bhd,hdr->bhr", q[..., :NOPE], w_uk).contiguous()
    row = dict(batch=batch, context=length, heads=heads, bf16_bytes=bf16_bytes, fp8_bytes=fp8_bytes,
               fp8_row_bytes=row_bytes, l2_rotation_copies=copies,
               bf16_floor_us=bf16_bytes / copy_tbps / 1e6, fp8_floor_us=fp8_bytes / copy_tbps / 1e6)

    def ours_bf16(i):
        return cuda_mla.latent_attention(q_lat, q, cu, context, block_tables, caches[i % copies], NOPE, SCALE)

    def ours_fp8(i):
        return cuda_mla.latent_attention(q_lat, q, cu, context, block_tables, caches8[i % copies], NOPE, SCALE,
                                         scale_group=FP8_GROUP)

    fns = {"ours_bf16": ours_bf16, "ours_fp8": ours_fp8}
    # the fp8 kernel against the bf16 kernel over the unquantised latents: the cache's accuracy cost
    row["fp8_vs_bf16_rel_err"] = rel_err(ours_fp8(0), ours_bf16(0))
    if flashmla:
        q_cat = torch.cat([q_lat, q[..., NOPE:]], dim=-1).view(batch, 1, heads, WIDTH)
        seqlens = torch.full((batch,), length, dtype=torch.int32, device="cuda")
        state = {}

        def flashmla_bf16(i):
            out, _, meta, splits = torch.ops._flashmla_C.dense_decode_fwd(
                q_cat, caches[i % copies].view(num_blocks, BLOCK, 1, WIDTH), RANK, seqlens, block_tables,
                SCALE, False, state.get("meta"), state.get("splits"), None)
            state["meta"], state["splits"] = meta, splits
            return out
        try:
            row["flashmla_vs_ours_bf16_rel_err"] = rel_err(flashmla_bf16(0).view(batch, heads, RANK), ours_bf16(0))
            fns["flashmla_bf16"] = flashmla_bf16
        except Exception as exc:  # record why the peer did not run, keep our numbers
            row["flashmla_error"] = repr(exc)[:300]
    for name, fn in fns.items():
        us = time_graph_ms(fn) * 1e3
        row[f"{name}_attn_graph_us"] = us
        floor = row["fp8_floor_us"] if name == "ours_fp8" else row["bf16_floor_us"]
        row[f"{name}_floor_frac"] = floor / us
    row["fp8_vs_bf16_speed"] = row["ours_bf16_attn_graph_us"] / row["ours_fp8_attn_graph_us"]
    if "flashmla_bf16_attn_graph_us" in row:
        row["fp8_vs_flashmla_speed"] = row["flashmla_bf16_attn_graph_us"] / row["ours_fp8_attn_graph_us"]
    return row


def fp8_main(args, flashmla):
    copy_tbps = copy_bandwidth()
    result = dict(commit=args.commit or commit_id(), source_hash=source_hash(), gpu=torch.cuda.get_device_name(),
                  date=datetime.date.today().isoformat(), torch=torch.__version__, copy_tbps=copy_tbps,
                  fp8_scale_group=FP8_GROUP, decode_fp8=[])
    print(f"copy {copy_tbps:.2f} TB/s")
    for shape in args.fp8_shapes:
        row = fp8_decode_case(*shape, copy_tbps, flashmla)
        torch.cuda.empty_cache()
        result["decode_fp8"].append(row)
        (args.out / "mla_fp8_cache_h200.json").write_text(json.dumps(result, indent=1))
        nan = float("nan")
        print(f"B={row['batch']:3d} L={row['context']:6d} H={row['heads']:4d}  us: bf16 "
              f"{row['ours_bf16_attn_graph_us']:.1f}"
              f" ({row['ours_bf16_floor_frac']:.0%} of floor)  fp8 {row['ours_fp8_attn_graph_us']:.1f}"
              f" ({row['ours_fp8_floor_frac']:.0%})  FlashMLA {row.get('flashmla_bf16_attn_graph_us', nan):.1f}"
              f"  fp8/bf16 speed {row['fp8_vs_bf16_speed']:.2f}  fp8 vs FlashMLA "
              f"{row.get('fp8_vs_flashmla_speed', nan):.2f}  fp8 err {row['fp8_vs_bf16_rel_err']:.1e}", flush=True)


def issue21_goals(result):
    """Issue 21's MLA goals, each with the value measured in this run (None: not measured)."""
    goals = []

    def goal(name, value, target):
        goals.append(dict(goal=name, value=value, target=target, met=None if value is None else value >= target))

    for r in result["decode"]:
        b, length, h = r["batch"], r["context"], r["heads"]
        shape = f"B {b} x {length} x {h} heads"
        if h <= 16:
            goal(f"decode attention >= 95% of copy, {shape}", r.get("ours_attn_graph_copy_frac"), 0.95)
        elif "flashmla_attn_graph_us" in r and "ours_attn_graph_us" in r:
            target = 2.0 if b == 1 else 1.2
            goal(f"decode attention >= {target}x FlashMLA, {shape}",
                 r["flashmla_attn_graph_us"] / r["ours_attn_graph_us"], target)
        else:
            goal(f"decode attention vs FlashMLA, {shape}", None, 2.0 if b == 1 else 1.2)
    for r in result["prefill"]:
        goal(f"prefill >= 0.9x SDPA attention, T {r['tokens']} x {r['heads']} heads", r["ours_vs_sdpa_attn_speed"], 0.9)
    for r in result["fp8"]:
        goal(f"fp8 cache attention ~1.8x the bf16 cache's speed, B {r['batch']} x {r['context']} x {r['heads']} heads",
             r["fp8_vs_bf16_speed"], 1.8)
    return goals


def issue21_main(args, flashmla):
    copy_tbps = copy_bandwidth()
    result = dict(commit=args.commit or commit_id(), source_hash=source_hash(), gpu=torch.cuda.get_device_name(),
                  date=datetime.date.today().isoformat(), torch=torch.__version__, copy_tbps=copy_tbps,
                  kernels_lib=os.environ.get("K3_KERNELS_LIB", "default"), flashmla=flashmla,
                  fp8_scale_group=FP8_GROUP, decode=[], prefill=[], fp8=[], goals=[], errors=[])
    print(f"copy {copy_tbps:.2f} TB/s", flush=True)
    path = args.out / "mla_issue21_h200.json"

    def add(section, case, args, text):
        """One row; a row that raises is recorded under "errors" and the run goes on."""
        try:
            row = case(*args)
        except Exception as exc:  # noqa: BLE001  (keep the other rows of the one device call)
            result["errors"].append(dict(section=section, args=list(args[:3]), error=repr(exc)[:300]))
            print(f"{section} {args[:3]}: ERROR {exc!r:.200}", flush=True)
            row = None
        torch.cuda.empty_cache()  # the next shape's caches are large
        if row is not None:
            result[section].append(row)
            print(text(row), flush=True)
        result["goals"] = issue21_goals(result)
        path.write_text(json.dumps(result, indent=1))

    nan = float("nan")
    for shape in ISSUE21_DECODE:
        add("decode", decode_case, (*shape, copy_tbps, flashmla, True), lambda r: (
            f"decode B={r['batch']} L={r['context']} H={r['heads']}: ours {r.get('ours_attn_graph_us', nan):.1f} us"
            f" ({r.get('ours_attn_graph_copy_frac', nan):.0%} of copy)  FlashMLA "
            f"{r.get('flashmla_attn_graph_us', nan):.1f} us  err {r['ours_vs_eager_rel_err']:.1e}"))
    for tokens, heads in ISSUE21_PREFILL:
        add("prefill", prefill_case, (tokens, heads), lambda r: (
            f"prefill T={r['tokens']} H={r['heads']} ({r['ours_path']}): ours {r['ours_whole_ms']:.2f} ms  SDPA "
            f"{r['sdpa_attn_ms']:.2f} ms  ours/SDPA {r['ours_vs_sdpa_attn_speed']:.2f}"))
    for shape in ISSUE21_FP8:
        add("fp8", fp8_decode_case, (*shape, copy_tbps, flashmla), lambda r: (
            f"fp8 B={r['batch']} L={r['context']} H={r['heads']}: bf16 {r['ours_bf16_attn_graph_us']:.1f} us  fp8 "
            f"{r['ours_fp8_attn_graph_us']:.1f} us ({r['ours_fp8_floor_frac']:.0%} of its floor)  speed "
            f"{r['fp8_vs_bf16_speed']:.2f}  FlashMLA {r.get('flashmla_bf16_attn_graph_us', nan):.1f} us"))
    print("issue 21 goals:")
    for g in result["goals"]:
        value = "n/a" if g["value"] is None else f"{g['value']:.2f}"
        verdict = "n/a " if g["met"] is None else "met " if g["met"] else "NOT "
        print(f"  {verdict} {value:>5} (goal {g['target']})  {g['goal']}")


def prefill_inputs(context, tokens, heads):
    """One sequence: `context` cached random latents, `tokens` new ones, contiguous blocks."""
    gen = torch.Generator(device="cuda").manual_seed(tokens + heads + context)
    blocks = -(-(context + tokens) // BLOCK)
    cache = torch.randn(blocks, BLOCK, WIDTH, generator=gen, device="cuda").to(torch.bfloat16)
    return dict(
        q=torch.randn(tokens, heads, NOPE + ROPE, generator=gen, device="cuda").to(torch.bfloat16),
        latent=torch.randn(tokens, WIDTH, generator=gen, device="cuda").to(torch.bfloat16),
        w_uk=(torch.randn(heads, NOPE, RANK, generator=gen, device="cuda") / NOPE ** 0.5).to(torch.bfloat16),
        w_uv=(torch.randn(heads, VDIM, RANK, generator=gen, device="cuda") / RANK ** 0.5).to(torch.bfloat16),
        cu_seqlens=torch.tensor([0, tokens], dtype=torch.int32, device="cuda"),
        context_lens=torch.tensor([context], dtype=torch.int32, device="cuda"),
        block_tables=torch.arange(blocks, dtype=torch.int32, device="cuda").view(1, -1),
        slot_mapping=torch.arange(context, context + tokens, dtype=torch.int32, device="cuda"),
        latent_cache=cache)


def op_args(x, heads):
    return (x["q"], x["latent"], x["w_uk"], x["w_uv"], x["cu_seqlens"], x["context_lens"], x["block_tables"],
            x["slot_mapping"], x["latent_cache"], heads, NOPE, ROPE, RANK, VDIM, SCALE)


def timed_rows(row, fns, tokens, reps, attn_flop=None):
    for name, fn in fns:
        ms = time_ms(fn, reps=reps, warmup=2, batch=1)
        row[f"{name}_ms"] = ms
        row[f"{name}_mtok_s"] = tokens / ms / 1e3
        if attn_flop:
            row[f"{name}_attn_tflops"] = attn_flop / ms / 1e9


def prefill_case(tokens, heads):
    x = prefill_inputs(0, tokens, heads)
    args = op_args(x, heads)
    q, latent, w_uk, w_uv = x["q"], x["latent"], x["w_uk"], x["w_uv"]

    def ours(i):
        return cuda_mla.mla_prefill_cuda(*args)

    def ours_absorbed(i):  # the decode op runs the absorbed form for any token count
        return cuda_mla.mla_decode_cuda(*args)

    def expand():
        c_kv, k_pe = latent[:, :RANK], latent[:, RANK:]
        k_nope = torch.einsum("tr,hdr->htd", c_kv, w_uk)
        k = torch.cat([k_nope, k_pe[None].expand(heads, -1, -1)], dim=-1)[None]
        v = torch.einsum("tr,hvr->htv", c_kv, w_uv)[None]
        return q.transpose(0, 1)[None], k, v

    qs, ks, vs = expand()

    def sdpa_attn(i):
        return F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, scale=SCALE)

    def sdpa_whole(i):
        qq, kk, vv = expand()
        return F.scaled_dot_product_attention(qq, kk, vv, is_causal=True, scale=SCALE)

    sizes = (tokens, 1, heads, NOPE, ROPE, RANK, VDIM, x["block_tables"].shape[1], BLOCK)
    row = dict(tokens=tokens, heads=heads, ours_path="expanded" if cuda_mla.prefill_uses_expanded(*sizes)
               else "absorbed")
    want = sdpa_attn(0)[0].transpose(0, 1).reshape(tokens, -1)
    row["ours_vs_sdpa_rel_err"] = rel_err(ours(0), want)
    row["absorbed_vs_sdpa_rel_err"] = rel_err(ours_absorbed(0), want)
    attn_flop = heads * tokens * (tokens + 1) / 2 * 2 * (NOPE + ROPE + VDIM)
    timed_rows(row, (("ours_whole", ours), ("ours_absorbed", ours_absorbed), ("sdpa_attn", sdpa_attn),
                     ("sdpa_whole", sdpa_whole)), tokens, 5 if tokens > 4096 else 10, attn_flop)
    row["ours_vs_sdpa_attn_speed"] = row["sdpa_attn_ms"] / row["ours_whole_ms"]
    row["ours_vs_sdpa_whole_speed"] = row["sdpa_whole_ms"] / row["ours_whole_ms"]
    row["ours_vs_absorbed_speed"] = row["ours_absorbed_ms"] / row["ours_whole_ms"]
    return row


def chunk_case(context, tokens, heads):
    """A chunk of new tokens after a cached context: both forms, same inputs."""
    x = prefill_inputs(context, tokens, heads)
    args = op_args(x, heads)
    row = dict(context=context, tokens=tokens, heads=heads)
    row["expanded_vs_absorbed_rel_err"] = rel_err(cuda_mla.prefill_expanded(*args), cuda_mla.mla_decode_cuda(*args))
    timed_rows(row, (("expanded", lambda i: cuda_mla.prefill_expanded(*args)),
                     ("absorbed", lambda i: cuda_mla.mla_decode_cuda(*args))), tokens, 10)
    row["expanded_vs_absorbed_speed"] = row["absorbed_ms"] / row["expanded_ms"]
    return row


def source_hash():
    digest = hashlib.sha256()
    for path in SOURCES:
        digest.update(path.relative_to(ROOT).as_posix().encode())
        digest.update(path.read_bytes())
    return digest.hexdigest()[:16]


def commit_id():
    try:
        out = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "HEAD"], capture_output=True, text=True)
        dirty = subprocess.run(["git", "-C", str(ROOT), "status", "--porcelain", "--", *map(str, SOURCES)],
                               capture_output=True, text=True).stdout.strip()
        return "uncommitted" if out.returncode or dirty else out.stdout.strip()
    except OSError:
        return "uncommitted"


def plot(result, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    rows = result["decode"]
    labels = [f"B{r['batch']} L{r['context']} H{r['heads']}" for r in rows]
    series = [("ours_attn", "ours (attention)"), ("flashmla_attn", "FlashMLA (attention)"),
              ("ours_whole", "ours (whole decode)"), ("flashmla_whole", "FlashMLA + torch bmm (whole)"),
              ("eager_attn", "torch eager (attention)")]
    fig, ax = plt.subplots(figsize=(11, 5))
    width = 0.16
    for k, (key, name) in enumerate(series):
        vals = [r.get(f"{key}_tbps", 0.0) for r in rows]
        ax.bar([i + (k - 2) * width for i in range(len(rows))], vals, width, label=name)
    ax.axhline(result["copy_tbps"], color="k", linestyle="--", linewidth=1, label="device copy")
    ax.set_xticks(range(len(rows)), labels)
    ax.set_ylabel("latent-cache TB/s")
    ax.set_title(f"MLA decode, bf16 latent 576, block 64 — {result['gpu']} ({result['date']})")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--flashmla", type=Path, default=ROOT / ".carry/_flashmla_C.abi3.so")
    parser.add_argument("--skip-prefill", action="store_true")
    parser.add_argument("--skip-decode", action="store_true")
    parser.add_argument("--shapes", type=lambda text: [tuple(int(x) for x in s.split("x")) for s in text.split(",")],
                        default=DECODE_SHAPES)
    parser.add_argument("--attn-only", action="store_true")
    parser.add_argument("--no-plot", action="store_true")
    parser.add_argument("--fp8-cache", action="store_true")
    parser.add_argument("--fp8-shapes", default=FP8_SHAPES,
                        type=lambda text: [tuple(int(x) for x in s.split("x")) for s in text.split(",")])
    parser.add_argument("--commit", default="", help="commit id to record (the device copy has no git)")
    parser.add_argument("--issue21", action="store_true", help="every MLA row of issue 21 -> mla_issue21_h200.json")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    flashmla = args.flashmla.exists()
    if flashmla:
        torch.ops.load_library(str(args.flashmla))
    if args.fp8_cache:
        fp8_main(args, flashmla)
        return
    if args.issue21:
        issue21_main(args, flashmla)
        return
    copy_tbps = copy_bandwidth()
    result = dict(commit=commit_id(), source_hash=source_hash(), gpu=torch.cuda.get_device_name(),
                  date=datetime.date.today().isoformat(), torch=torch.__version__, copy_tbps=copy_tbps,
                  decode=[], prefill=[], prefill_chunks=[])
    print(f"copy {copy_tbps:.2f} TB/s")
    for shape in [] if args.skip_decode else args.shapes:
        row = decode_case(*shape, copy_tbps, flashmla, args.attn_only)
        torch.cuda.empty_cache()  # the next shape's caches are large
        result["decode"].append(row)
        print(" ".join(f"{k}={v:.3g}" if isinstance(v, float) else f"{k}={v}" for k, v in row.items()), flush=True)
        (args.out / "mla_h200.json").write_text(json.dumps(result, indent=1))
    if not args.skip_prefill:
        for heads in PREFILL_HEADS:
            for tokens in PREFILL_T:
                row = prefill_case(tokens, heads)
                result["prefill"].append(row)
                print(" ".join(f"{k}={v:.3g}" if isinstance(v, float) else f"{k}={v}" for k, v in row.items()),
                      flush=True)
                (args.out / "mla_h200.json").write_text(json.dumps(result, indent=1))
        for heads in PREFILL_HEADS:
            for tokens in CHUNK_NEW:
                row = chunk_case(CHUNK_CONTEXT, tokens, heads)
                result["prefill_chunks"].append(row)
                print(" ".join(f"{k}={v:.3g}" if isinstance(v, float) else f"{k}={v}" for k, v in row.items()),
                      flush=True)
                (args.out / "mla_h200.json").write_text(json.dumps(result, indent=1))
    if not args.no_plot and result["decode"]:
        plot(result, args.out / "mla_h200.png")
    print("decode summary (attention us, TB/s, fraction of copy):")
    nan = float("nan")
    for r in result["decode"]:
        print(f"  B={r['batch']:4d} L={r['context']:6d} H={r['heads']:4d}  ours attn {r['ours_attn_us']:.1f} us "
              f"{r['ours_attn_tbps']:.2f} ({r['ours_attn_copy_frac']:.0%})  FlashMLA attn "
              f"{r.get('flashmla_attn_us', nan):.1f} us {r.get('flashmla_attn_tbps', nan):.2f} "
              f"({r.get('flashmla_attn_copy_frac', nan):.0%})  whole {r.get('ours_whole_tbps', nan):.2f}  "
              f"eager {r.get('eager_attn_tbps', nan):.2f}")
        if "ours_attn_graph_us" in r:
            print(f"    graphs: ours {r['ours_attn_graph_us']:.1f} us ({r['ours_attn_graph_copy_frac']:.0%})  FlashMLA "
                  f"{r.get('flashmla_attn_graph_us', nan):.1f} us  ratio "
                  f"{r.get('flashmla_attn_graph_us', nan) / r['ours_attn_graph_us']:.2f}  (events ratio "
                  f"{r.get('flashmla_attn_us', nan) / r['ours_attn_us']:.2f})")
    print("prefill summary (M tok/s; attention TFLOP/s):")
    for r in result["prefill"]:
        print(f"  T={r['tokens']:6d} H={r['heads']:3d} {r['ours_path']}: {r['ours_whole_mtok_s']:.3f} "
              f"({r['ours_whole_attn_tflops']:.0f})  absorbed {r['ours_absorbed_mtok_s']:.3f}  SDPA attn "
              f"{r['sdpa_attn_mtok_s']:.3f} ({r['sdpa_attn_attn_tflops']:.0f})  SDPA+expand "
              f"{r['sdpa_whole_mtok_s']:.3f}  ours/SDPA {r['ours_vs_sdpa_attn_speed']:.2f}  err "
              f"{r['ours_vs_sdpa_rel_err']:.1e}")
    for r in result["prefill_chunks"]:
        print(f"  ctx={r['context']} n={r['tokens']:4d} H={r['heads']:3d}: expanded {r['expanded_ms']:.3f} ms, "
              f"absorbed {r['absorbed_ms']:.3f} ms, ratio {r['expanded_vs_absorbed_speed']:.2f}, "
              f"err {r['expanded_vs_absorbed_rel_err']:.1e}")
    if result["decode"] and "ours_whole_us" in result["decode"][0]:
        print("whole decode (us; FlashMLA + torch bmm):")
        for r in result["decode"]:
            print(f"  B={r['batch']:4d} L={r['context']:6d} H={r['heads']:4d}  ours {r['ours_whole_us']:.1f}  "
                  f"FlashMLA+bmm {r.get('flashmla_whole_us', nan):.1f}  ratio "
                  f"{r.get('flashmla_whole_us', nan) / r['ours_whole_us']:.2f}  eager {r['eager_whole_us']:.1f}")


if __name__ == "__main__":
    main()
