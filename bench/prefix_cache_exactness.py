#!/usr/bin/env python3
"""Prefix-cache exactness on one device (issue 22): the tokens of P+B (a) uncached in one prefill, (b) uncached
with the prefill cut after P (max_num_tokens = len(P)), (c) after P+A on a cached engine with the same budget
(a hit restoring the snapshot at len(P), which the prefill took at its first chunk's end, the others mid-chunk).
(b) and (c) compute the same chunks: they must agree exactly. (d): P[:200]+B on that engine restores the
snapshot at 192, taken mid-chunk: equal to its uncached run in fp32 (in bf16 a prefill cut elsewhere rounds
differently, as (a) vs (b) shows).

    python bench/prefix_cache_exactness.py cuda bfloat16   (after build_scripts/build_kernels.sh)
    python bench/prefix_cache_exactness.py cpu float32"""
import json
import random
import sys

import torch

sys.path.insert(0, ".")
from k3_trtllm.runtime.engine import build_engine
from k3_trtllm.runtime.sequence import SamplingParams

dev, dtype_name = sys.argv[1], sys.argv[2]
dtype = getattr(torch, dtype_name)
rng = random.Random(0)
P = [rng.randrange(3, 1000) for _ in range(256)]
A = [rng.randrange(3, 1000) for _ in range(8)]
B = [rng.randrange(3, 1000) for _ in range(8)]
sp = SamplingParams(max_new_tokens=24, temperature=0.0, ignore_eos=True)

def run(prompts, **kw):
    eng = build_engine("examples/tiny-k3", dtype=dtype, device=dev, block_size=16, max_batch_size=1,
                       max_seq_len=1024, num_blocks=256, max_slots=4, **kw)
    outs = []
    for p in prompts:
        rid = eng.add_request(p, sp)
        while eng.has_unfinished():
            eng.step()
        r = eng.take_result(rid)
        outs.append((r.output_token_ids, getattr(r, "cached_tokens", None)))
    return outs

D = P[:200] + B
a = run([P + B, D], max_num_tokens=2048)
b = run([P + B], max_num_tokens=len(P))
c = run([P + A, P + B, D], max_num_tokens=len(P), prefix_cache=True, prefix_cache_interval=64, snapshot_slots=8)
res = {"device": dev, "dtype": dtype_name, "a_whole": a[0][0], "b_chunked": b[0][0], "c_cached": c[1][0],
       "c_cached_tokens": c[1][1], "b_eq_c": b[0][0] == c[1][0], "a_eq_b": a[0][0] == b[0][0], "a_eq_c": a[0][0] == c[1][0],
       "d_cached_tokens": c[2][1], "d_eq_uncached": c[2][0] == a[1][0]}
print(json.dumps({k: v for k, v in res.items() if not isinstance(v, list)}))
