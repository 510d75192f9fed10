"""The MoE kernels of one K3 EP8 rank, each case called eagerly under an NVTX range, for ncu.

    ncu --nvtx --nvtx-include 'ep8_T1/' ... python3 bench/ncu_moe.py
Cases (moe_bench.py's shapes and random weights): MXFP4 decode as one EP8 rank sees it (router
over 896 experts, 112 local) at T = 1 and 32, all 112 experts local at T = 8 and 64, and the EP8
rank's 4096-token prefill. Each case runs twice unrecorded (warm-up, lazy loads) and once inside
its range, so a profiler given the range sees one call of every kernel of the case.
"""
from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import moe_bench as mb  # noqa: E402


def case(name: str, T: int, num_experts: int, experts, g: torch.Generator) -> None:
    x, z, router, bias = mb.inputs(T, g, num_experts)
    offset = 0
    if num_experts != mb.E:  # EP rank: the shard holding token 0's best expert
        ids, _ = mb.moe_kernels.route(x, router, bias, mb.TOP_K, 1, 1, 0, True, 1.0)
        offset = int(ids[0, 0]) // mb.EL * mb.EL
    attrs = (num_experts, *mb.ATTRS[1:4], offset, *mb.ATTRS[5:])
    call = lambda: torch.ops.k3.situ_moe_mxfp4(x, z, router, bias, *experts, *attrs)  # noqa: E731
    call(), call()
    torch.cuda.synchronize()
    torch.cuda.nvtx.range_push(name)
    call()
    torch.cuda.synchronize()
    torch.cuda.nvtx.range_pop()
    print(name, "done", flush=True)


def main() -> None:
    g = torch.Generator(device="cuda").manual_seed(0)
    experts = mb.make_experts(True, g)
    wanted = set(sys.argv[1:])
    for name, T, num_experts in (("ep8_T1", 1, mb.EP_E), ("ep8_T32", 32, mb.EP_E), ("all_T8", 8, mb.E),
                                 ("all_T64", 64, mb.E), ("ep8_prefill", mb.PREFILL_T, mb.EP_E)):
        if not wanted or name in wanted:
            case(name, T, num_experts, experts, g)


if __name__ == "__main__":
    main()
