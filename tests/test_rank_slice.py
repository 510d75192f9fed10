"""bench/rank_slice.py at tiny dims on CPU: the rank's shapes, the floor accounting (checked
against the pools' own rows, the state dict and the products the step really ran), the
extrapolation arithmetic and the repeat check (bitwise equal on the deterministic reference
ops; a planted difference is found and named)."""
from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest
import torch

from k3_trtllm.model import layers as model_layers
from k3_trtllm.ops.moe import reference as moe_op

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "examples" / "tiny-k3" / "config.json"
_spec = importlib.util.spec_from_file_location("rank_slice", ROOT / "bench" / "rank_slice.py")
rs = importlib.util.module_from_spec(_spec)
sys.modules["rank_slice"] = rs  # dataclasses look their module up there
_spec.loader.exec_module(rs)

CPU = torch.device("cpu")


def _rank(tp=2, ep=2, layers=4, seqs=16, tokens=64):
    data = json.loads(TINY.read_text())
    cfg = rs.slice_config(data, layers, str(TINY))
    par = rs.rank_parallel(cfg, tp, ep)
    layout = rs.PoolLayout(seqs, tokens, 16)
    model, caches = rs.build_rank(cfg, par, layout, CPU, seed=0)
    return cfg, par, layout, model, caches, rs.TorchExecutor(model, caches, CPU)


@pytest.fixture(scope="module")
def rank():
    return _rank()


def test_slice_keeps_k3s_layer_pattern_and_one_ranks_shapes(rank):
    cfg, par, _, model, caches, _ = rank
    assert [f"{p.attention}/{p.ffn}" for p in cfg.layers] == ["kda/dense", "kda/moe", "kda/moe", "mla/moe"]
    assert par.tp_size == 1 and par.shard == 2 and par.moe_ep_size == 2  # no collectives, rank dims
    assert model.transformer.layers[0].attention.num_heads == 2  # 4 heads / tp 2
    assert model.lm_head.weight.shape[0] == 512  # vocab 1024 / tp 2
    assert model.transformer.layers[1].mlp.experts.w13.weight_packed.shape[0] == 4  # 8 experts / ep 2
    assert caches.recurrent[0].shape[1] == 2  # the rank's KDA heads' states
    for name, buf in model.named_buffers():  # random, finite, no zero tensors
        assert buf.float().abs().sum() > 0 and torch.isfinite(buf.float()).all(), name
    assert model.transformer.layers[1].mlp.router.weight.dtype == torch.float32


def _routing_used_by_the_op(monkeypatch):
    """The top-k ids the MoE op itself computed in each call (the reference op's own router)."""
    seen = []
    real = moe_op.route

    def spy(*args, **kwargs):
        ids, w = real(*args, **kwargs)
        seen.append(ids.clone())
        return ids, w
    monkeypatch.setattr(moe_op, "route", spy)
    return seen


def test_decode_floor_counts_weights_touched_experts_states_and_latent(rank, monkeypatch):
    cfg, par, layout, model, caches, executor = rank
    gen = torch.Generator().manual_seed(1)
    batch, ctx = 16, 20
    step, decode = rs.make_step([(1, ctx)] * batch, layout, 512, gen)
    op_ids = _routing_used_by_the_op(monkeypatch)
    rec = rs.record_routing(executor, step, decode)
    moe_layers = sorted(rec.touched)
    assert len(op_ids) == len(moe_layers) == 3
    for layer, ids in zip(moe_layers, op_ids):
        off = model.transformer.layers[layer].mlp.expert_offset
        local = ids[(ids >= off) & (ids < off + 4)]
        assert rec.touched[layer] == local.unique().numel()
        assert rec.pairs[layer] == local.numel()
    # 16 tokens x top-3 of 8 experts touch all 4 local experts of every layer with this seed
    assert all(v == 4 for v in rec.touched.values())
    floor = rs.decode_floor_bytes(model, cfg, par.shard, rec, batch, ctx, int(step.input_ids.unique().numel()))
    every_byte = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    emb = model.transformer.vocab_embedding.weight
    assert floor["weights_dense"] + floor["experts_touched"] + emb.numel() * emb.element_size() == every_byte
    state_row = sum(caches.conv[i][0].nbytes + caches.recurrent[i][0].nbytes for i in caches.conv)
    assert floor["kda_states_read_written"] == 2 * batch * state_row
    latent_row = sum(t[0, 0].nbytes for t in caches.latent.values())
    assert floor["latent_read"] == batch * ctx * latent_row
    assert floor["latent_written"] == batch * latent_row
    assert floor["embedding_rows"] == step.input_ids.unique().numel() * emb.shape[1] * emb.element_size()
    assert floor["total"] == sum(v for k, v in floor.items() if k != "total")
    kinds = rs.floor_by_kind(model, cfg, par.shard, rec, batch, ctx, floor["total"])
    counts = rs.layer_counts(cfg)
    assert kinds["head"] + sum(counts[k] * v for k, v in kinds.items() if k != "head") == pytest.approx(floor["total"])
    lm = model.lm_head.weight
    assert kinds["head"] >= lm.numel() * lm.element_size()  # the LM head is the head's


def test_prefill_flops_match_the_products_the_step_ran(rank, monkeypatch):
    cfg, par, layout, model, caches, executor = rank
    gen = torch.Generator().manual_seed(2)
    entries = [(24, 0), (8, 16)]
    step, decode = rs.make_step(entries, layout, 512, gen)
    op_ids = _routing_used_by_the_op(monkeypatch)
    linear_flops = []
    real_linear = model_layers.linear
    # a KDA in_proj runs with its rows padded (KdaAttention.pad_in_proj_): the pad is no product
    # the step needs, so it counts the checkpoint's rows (its buffer, a view at the same address)
    needed = {m.in_proj.weight.data_ptr(): m.in_proj.weight.numel()
              for m in model.modules() if isinstance(m, model_layers.KdaAttention)}

    def counting_linear(x, w, *a):
        linear_flops.append(2 * (x.numel() // x.shape[-1]) * needed.get(w.data_ptr(), w.numel()))
        return real_linear(x, w, *a)
    monkeypatch.setattr(model_layers, "linear", counting_linear)
    rec = rs.record_routing(executor, step, decode)
    flops = rs.prefill_flops(model, cfg, entries, rec, step.num_seqs)
    tokens = step.num_tokens
    router = sum(2 * tokens * model.transformer.layers[i].mlp.router.weight.numel() for i in rec.touched)
    conv = sum(2 * tokens * model.transformer.layers[i].attention.conv1d.weight.numel() for i in cfg.kda_layer_indices)
    # the model's nn.functional.linear calls, plus the router product and the depthwise conv
    # inside the ops (linear_flops holds two runs: record_routing's and none other)
    assert flops["dense_products"] == sum(linear_flops) + router + conv
    assert flops["lm_head"] == 2 * step.num_seqs * model.lm_head.weight.numel()
    pairs = 0
    for layer, ids in zip(sorted(rec.touched), op_ids):
        off = model.transformer.layers[layer].mlp.expert_offset
        pairs += int(((ids >= off) & (ids < off + 4)).sum())
    w13 = model.transformer.layers[1].mlp.experts.w13.weight_packed
    inter, latent = w13.shape[1] // 2, w13.shape[2] * 2
    assert flops["experts"] == 2 * pairs * 3 * inter * latent
    assert flops["total"] == sum(v for k, v in flops.items() if k != "total")


def test_extrapolation_recovers_the_whole_model_from_per_kind_times():
    parts = {"kda_attention": 1.0, "mla_attention": 2.0, "dense_ffn": 3.0, "moe_ffn": 5.0, "head": 0.5}
    slice_counts = {"kda_attention": 3, "mla_attention": 1, "dense_ffn": 1, "moe_ffn": 3, "layers": 4}
    full = {"kda_attention": 6, "mla_attention": 2, "dense_ffn": 1, "moe_ffn": 7, "layers": 8}
    rest = 0.25
    step = 0.5 + 3 * 1 + 2 + 3 + 3 * 5 + 4 * rest
    out = rs.extrapolate(parts, step, slice_counts, full)
    assert out["rest_per_layer_ms"] == pytest.approx(rest)
    assert out["whole_model_ms"] == pytest.approx(0.5 + 6 + 4 + 3 + 35 + 8 * rest)


def test_repeat_check_is_bitwise_equal_on_the_reference_ops(rank):
    cfg, par, layout, model, caches, executor = rank
    gen = torch.Generator().manual_seed(3)
    before = rs.snapshot(caches)
    for entries in ([(1, 20)] * 3, [(1, 20)] * 2 + [(12, 0)]):
        step, decode = rs.make_step(entries, layout, 512, gen)
        r = rs.repeat_case(executor, caches, step, decode)
        assert r["repeat_diffs"] == []
    assert rs.bitwise_diffs(before, rs.pool_tensors(caches)) == []  # caches left as found


class _FlakyExecutor:
    """Adds a planted difference to one pool on its second call: what a racy kernel does."""

    def __init__(self, inner, caches):
        self.inner, self.caches, self.calls = inner, caches, 0
        self.device, self.model = inner.device, inner.model

    def execute(self, step, decode):
        out = self.inner.execute(step, decode)
        self.calls += 1
        if self.calls == 2:
            self.caches.recurrent[1][0, 0, 0, :3] += 1e-3
        return out


def test_repeat_check_finds_and_names_a_planted_difference(rank):
    cfg, par, layout, model, caches, executor = rank
    step, decode = rs.make_step([(1, 20)] * 2, layout, 512, torch.Generator().manual_seed(4))
    r = rs.repeat_case(_FlakyExecutor(executor, caches), caches, step, decode)
    assert [d["tensor"] for d in r["repeat_diffs"]] == ["recurrent[1]"]
    d = r["repeat_diffs"][0]
    assert d["elements_differing"] == 3 and d["max_abs_diff"] == pytest.approx(1e-3, rel=1e-3)
    assert "recurrent[1] (3/" in rs.describe_diffs(r["repeat_diffs"])


def test_bitwise_diffs_compare_bits_not_values():
    nan = torch.tensor([float("nan"), 0.0, 1.0])
    assert rs.bitwise_diffs({"a": nan}, {"a": nan.clone()}) == []  # same NaN bits: equal
    signed = torch.tensor([0.0, 1.0, 1.0])
    diffs = rs.bitwise_diffs({"a": signed}, {"a": torch.tensor([-0.0, 1.0, 1.0])})  # == but not bitwise
    assert diffs[0]["elements_differing"] == 1


@pytest.mark.parametrize("argv, message", [
    (["--tp", "3", "--ep", "1"], "num_attention_heads = 4 is not divisible by --tp 3"),
    (["--layers", "11"], "--layers 11: expected 1 .. num_hidden_layers = 10"),
    (["--config", "/nonexistent/config.json"], "--config /nonexistent/config.json"),
])
def test_bad_input_is_one_line_and_exit_2(argv, message, capsys):
    args = ["--device", "cpu", "--config", str(TINY), *argv]
    assert rs.main(args) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and "\n" not in err and "Traceback" not in err


def test_cpu_benchmark_writes_every_figure(tmp_path, capsys):
    out = tmp_path / "r.json"
    assert rs.main(["--device", "cpu", "--config", str(TINY), "--tp", "2", "--ep", "2", "--layers", "4",
                    "--batches", "2", "--contexts", "16", "--prefill-tokens", "16", "--iters", "1",
                    "--warmup", "0", "--prefill-iters", "1", "--copy-mib", "1", "--gemm-n", "64",
                    "--extrapolate-tp", "4", "--extrapolate-ep", "4", "--out", str(out)]) == 0
    r = json.loads(out.read_text())
    (d,) = r["decode"]
    assert d["floor_ms"] > 0 and d["eager"]["median_ms"] > 0
    assert set(d["parts_eager_ms"]) == {"kda_attention", "mla_attention", "dense_ffn", "moe_ffn", "head"}
    assert d["extrapolated_eager"]["layers"] == 10  # the config's whole model
    assert len(r["prefill"]) == 2 and all(p["flops"]["total"] > 0 for p in r["prefill"])
    assert r["extrapolation_rank"]["slice"]["tp"] == 4 and r["extrapolation_rank"]["batch_1"]
    assert r["warnings"] == []


# -- the executor's decode path (issue 20 item 2; the CUDA-graph replay itself is tested on the
#    GPU in tests/gpu/test_executor_graphs.py) --------------------------------------------------
def test_padded_block_tables_change_nothing_but_the_launch_shape(rank):
    """Decode steps run at a power-of-two block-table width: on the reference ops the padded
    step gives bitwise the same logits and caches as the step as built."""
    from k3_trtllm.runtime.executor import pad_block_tables, padded_width
    assert [padded_width(w) for w in (1, 2, 3, 4, 5, 33, 64)] == [1, 2, 4, 4, 8, 64, 64]
    cfg, par, layout, model, caches, executor = rank
    step, decode = rs.make_step([(1, 20), (1, 36)], layout, 512, torch.Generator().manual_seed(5))
    assert decode
    assert step.block_tables.shape[1] == 3
    padded = pad_block_tables(step, 8)
    assert padded.block_tables.shape[1] == 8 and (padded.block_tables[:, 3:] == 0).all()
    assert torch.equal(padded.block_tables[:, :3], step.block_tables)
    before = rs.snapshot(caches)
    ref = {"logits": executor.execute(step, decode).clone(), **rs.snapshot(caches)}
    rs.restore(caches, before)
    got = {"logits": executor.execute(padded, decode), **rs.pool_tensors(caches)}
    assert rs.bitwise_diffs(ref, got) == []
    rs.restore(caches, before)


def test_cuda_graphs_are_off_on_cpu_and_refused_there(rank):
    cfg, par, layout, model, caches, executor = rank
    assert executor.cuda_graphs is False and executor.graphs == {}
    with pytest.raises(ValueError, match="cuda_graphs: needs a CUDA device"):
        rs.TorchExecutor(model, caches, CPU, cuda_graphs=True)
