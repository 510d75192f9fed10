"""Tensor and expert parallelism of the reference model: converted checkpoints of world
size 2 (tp 2 with ep 1 and ep 2, bf16 and MXFP4 experts), run in 2 processes over gloo,
give the logits of the world-1 model for a prefill step and two decode steps.

Everything runs in fp64. The sharded model computes the same products as the world-1
model, split into per-rank partial sums that the all-reduces add back (heads, MLP
intermediates, experts and their intermediate slices, vocab columns gathered): only the
order of additions differs: measured 2e-14 relative to the largest logit; tolerance 1e-9
as in test_model.py. A missing or doubled all-reduce, a wrong expert offset or a wrong local
split changes the logits by O(1)."""
from __future__ import annotations


import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from k3_trtllm.checkpoint.hf import CheckpointError
from k3_trtllm.convert import convert_checkpoint
from k3_trtllm.model import build_step, load_model

from helpers import free_port

BS = 16
WORLD = 2
SHARDINGS = [("tiny", 2, 1), ("tiny", 2, 2), ("tiny-mxfp4", 2, 1), ("tiny-mxfp4", 2, 2)]
F64 = dict(rtol=1e-9, atol=1e-9)


def _prompt(seed: int, n: int) -> list[int]:
    return torch.randint(3, 1024, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _prefill_then_two_decodes(model) -> torch.Tensor:
    """Two sequences (21 and 9 tokens) prefilled together, then two decode steps of both."""
    a, b = _prompt(1, 23), _prompt(2, 11)
    tables = [[0, 1], [2]]
    caches = model.allocate_caches(4, BS, 2)
    rows = [model(build_step([(a[:21], 0, 0, tables[0]), (b[:9], 0, 1, tables[1])], BS, logits_all=True), caches,
                  decode=False)]
    for i in range(2):
        rows.append(model(build_step([([a[21 + i]], 21 + i, 0, tables[0]), ([b[9 + i]], 9 + i, 1, tables[1])], BS),
                          caches, decode=True))
    return torch.cat(rows)


def _rank_worker(rank: int, port: int, paths: list[str], out: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD)
    try:
        logits = [_prefill_then_two_decodes(load_model(p, dtype=torch.float64)) for p in paths]
        torch.save(logits, f"{out}/rank{rank}.pt")
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def world2_logits(ckpt_dir, tmp_path_factory):
    """Per sharding: the logits of both ranks, from one spawn of 2 processes."""
    root = tmp_path_factory.mktemp("parallel")
    paths = []
    for i, (preset, tp, ep) in enumerate(SHARDINGS):
        paths.append(str(root / f"ckpt{i}"))
        convert_checkpoint(ckpt_dir(preset), paths[-1], tp, ep, progress=False)
    mp.spawn(_rank_worker, args=(free_port(), paths, str(root)), nprocs=WORLD, join=True)
    per_rank = [torch.load(root / f"rank{r}.pt") for r in range(WORLD)]
    return {s: [per_rank[r][i] for r in range(WORLD)] for i, s in enumerate(SHARDINGS)}


@pytest.mark.parametrize("sharding", SHARDINGS, ids=[f"{p}-tp{t}-ep{e}" for p, t, e in SHARDINGS])
def test_world2_logits_equal_world1(sharding, world2_logits, ckpt_dir):
    reference = _prefill_then_two_decodes(load_model(ckpt_dir(sharding[0]), dtype=torch.float64))
    for logits in world2_logits[sharding]:
        assert logits.shape == reference.shape == (30 + 2 * 2, 1024)
        torch.testing.assert_close(logits, reference, **F64)


def test_world2_checkpoint_needs_a_matching_process_group(ckpt_dir, tmp_path):
    path = tmp_path / "tp2"
    convert_checkpoint(ckpt_dir("tiny"), path, 2, 1, progress=False)
    with pytest.raises(CheckpointError, match="world size 2, and this process runs no torch.distributed"):
        load_model(path)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    try:
        with pytest.raises(CheckpointError, match="world size 2, and this process runs a process group of 1"):
            load_model(path)
    finally:
        dist.destroy_process_group()
