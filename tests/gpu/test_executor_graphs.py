"""TorchExecutor's CUDA-graph decode (issue 20 item 2) on the shipped tiny K3: every decode
step, replayed from a graph, gives bitwise the logits and caches that the eager step at the
same (padded) block-table width gives from the same caches; the first step of a shape runs
eagerly and captures, later ones replay; prefill and mixed steps never touch a graph.

Skipped without CUDA or without the kernel library (build_scripts/build_kernels.sh)."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from k3_trtllm.ops.cuda_library import library_path

ROOT = Path(__file__).resolve().parents[2]
TINY = ROOT / "examples" / "tiny-k3"
BS = 16

pytestmark = [
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
    pytest.mark.skipif(not library_path().exists(), reason=f"kernel library {library_path()} not built"),
]


def _pools(caches) -> dict[str, torch.Tensor]:
    out = {f"latent[{i}]": t for i, t in caches.latent.items()}
    out.update({f"conv[{i}]": t for i, t in caches.conv.items()})
    out.update({f"recurrent[{i}]": t for i, t in caches.recurrent.items()})
    return out


def _differing(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> list[str]:
    bits = {2: torch.int16, 4: torch.int32}
    return [k for k in a if not torch.equal(a[k].view(bits[a[k].element_size()]), b[k].view(bits[b[k].element_size()]))]


@pytest.mark.parametrize("num_seqs", [1, 3])
def test_decode_graph_replay_equals_the_eager_step_bitwise(num_seqs):
    from k3_trtllm.model import build_step, load_model
    from k3_trtllm.runtime.executor import TorchExecutor, pad_block_tables, padded_width
    model = load_model(TINY, dtype=torch.bfloat16, device="cuda")
    caches = model.allocate_caches(8 * num_seqs, BS, num_seqs)
    eager = TorchExecutor(model, caches, "cuda", cuda_graphs=False)
    graphs = TorchExecutor(model, caches, "cuda")
    assert graphs.cuda_graphs  # the default on CUDA
    gen = torch.Generator().manual_seed(num_seqs)
    prompts = [torch.randint(3, 1024, (40,), generator=gen).tolist() for _ in range(num_seqs)]
    lengths = [13 + 7 * i for i in range(num_seqs)]  # different contexts, one shared width bucket
    tables = [list(range(8 * i, 8 * i + 8)) for i in range(num_seqs)]
    graphs.execute(build_step([(p[:n], 0, i, t) for i, (p, n, t) in enumerate(zip(prompts, lengths, tables))], BS),
                   decode=False)
    assert graphs.graphs == {}  # prefill stays eager
    for d in range(5):
        step = build_step([([p[n + d]], n + d, i, t[: (n + d) // BS + 1])
                           for i, (p, n, t) in enumerate(zip(prompts, lengths, tables))], BS)
        before = {k: t.clone() for k, t in _pools(caches).items()}
        ref = eager.execute(pad_block_tables(step, padded_width(step.block_tables.shape[1])), decode=True)
        ref_pools = {k: t.clone() for k, t in _pools(caches).items()}
        for k, t in _pools(caches).items():
            t.copy_(before[k])
        got = graphs.execute(step, decode=True)
        torch.cuda.synchronize()
        assert torch.equal(got.view(torch.int32), ref.view(torch.int32)), f"decode step {d}: logits differ"
        assert _differing(ref_pools, _pools(caches)) == [], f"decode step {d}"
    assert graphs.graph_replays >= 3 and len(graphs.graphs) <= 2


def test_a_shape_whose_capture_fails_runs_eagerly_with_one_warning(monkeypatch):
    """A capture that raises (an op that syncs inside it) must not end the run: that shape stays
    eager, the logits are the eager ones, and no later step of that shape tries again."""
    from k3_trtllm.model import build_step, load_model
    from k3_trtllm.runtime import executor as executor_module
    from k3_trtllm.runtime.executor import TorchExecutor
    model = load_model(TINY, dtype=torch.bfloat16, device="cuda")
    caches = model.allocate_caches(8, BS, 1)
    graphs = TorchExecutor(model, caches, "cuda")
    attempts = []

    def failing_capture(*args, **kwargs):
        attempts.append(args)
        raise RuntimeError("operation not permitted when stream is capturing")

    monkeypatch.setattr(executor_module, "_DecodeGraph", failing_capture)
    graphs.execute(build_step([(list(range(3, 20)), 0, 0, list(range(8)))], BS), decode=False)
    with pytest.warns(RuntimeWarning, match="run eagerly"):
        graphs.execute(build_step([([20], 17, 0, [0, 1])], BS), decode=True)
    for d in range(3):
        logits = graphs.execute(build_step([([21 + d], 18 + d, 0, [0, 1])], BS), decode=True)
        assert torch.isfinite(logits).all()
    assert len(attempts) == 1 and graphs.graphs == {} and graphs.graph_replays == 0


def test_a_replay_zeroes_the_block_table_columns_past_its_step():
    """A replay leaves the graph's block tables as ``pad_block_tables`` would: a step narrower than
    the one before it in the same graph (widths 4 and 3 both run at 4) finds the wider step's last
    column zeroed, not left over."""
    from k3_trtllm.model import build_step, load_model
    from k3_trtllm.runtime.executor import TorchExecutor, pad_block_tables
    model = load_model(TINY, dtype=torch.bfloat16, device="cuda")
    caches = model.allocate_caches(8, BS, 1)
    graphs = TorchExecutor(model, caches, "cuda")
    graphs.execute(build_step([(list(range(3, 53)), 0, 0, list(range(4)))], BS), decode=False)
    checked = 0
    for ctx, width in ((50, 4), (50, 4), (40, 3), (41, 4), (42, 3), (43, 3)):
        step = build_step([([7 + ctx], ctx, 0, list(range(1, width + 1)))], BS)
        replays = graphs.graph_replays
        logits = graphs.execute(step, decode=True)
        torch.cuda.synchronize()
        assert torch.isfinite(logits).all()
        if graphs.graph_replays > replays:
            assert torch.equal(graphs.graphs[(1, 4)].step.block_tables.cpu(), pad_block_tables(step, 4).block_tables)
            checked += 1
    assert checked == 5
