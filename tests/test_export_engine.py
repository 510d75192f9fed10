"""`k3-trt build` on the converted tiny model (examples/tiny-k3, MXFP4 experts): ONNX
export, checker, CPU execution of the graph against the torch model, the build config's
I/O and pool aliases against the graph, and (with TensorRT-RTX installed) a plan built through the ONNX parser
with Python creators generated from the contracts.

The engine is built once in fp32: onnx's reference evaluator has no usable bf16 math,
and fp32 lets the graph be compared with the torch model tightly. The graph's nodes are
the same in bf16 (only tensor types differ)."""
from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import onnx
import pytest
import torch
from click.testing import CliRunner

from k3_trtllm.cli import main
from k3_trtllm.export.cpu_eval import CpuStepGraph
from k3_trtllm.export.engine_io import engine_inputs, engine_outputs, flatten_step, pool_tensor
from k3_trtllm.export.exporter import check_onnx
from k3_trtllm.export.schemas import DOMAIN
from k3_trtllm.model import build_step, load_model
from k3_trtllm.model.step import is_pure_decode
from k3_trtllm.ops.contract import ALL_CONTRACTS
from k3_trtllm.trt.builder import PlanBuildError, build_plan

BS = 16
HAVE_RTX = importlib.util.find_spec("tensorrt_rtx_bindings") is not None
NEEDS_RTX = pytest.mark.skipif(not HAVE_RTX, reason="TensorRT-RTX not installed (pip install "
                               "tensorrt-rtx-cu13-bindings tensorrt-rtx-cu13-libs)")


ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    work = tmp_path_factory.mktemp("engine")
    ckpt, out = work / "tiny-converted", work / "tiny-fp32"
    converted = CliRunner().invoke(main, ["convert", str(ROOT / "examples/tiny-k3"), str(ckpt)])
    assert converted.exit_code == 0, converted.output
    args = ["build", str(ckpt), str(out), "--dtype", "float32", "--max-batch-size", "4", "--max-num-tokens", "64",
            "--max-seq-len", "256", "--block-size", str(BS)]
    if HAVE_RTX:
        from trt_creators import register_python_creators

        from k3_trtllm.trt.bindings import import_tensorrt

        register_python_creators(import_tensorrt("tensorrt-rtx"))
        args += ["--builder", "tensorrt-rtx"]
    else:
        args += ["--builder", "none"]
    result = CliRunner().invoke(main, args, catch_exceptions=False)
    assert result.exit_code == 0, result.output
    return ckpt, out


def test_graph_passes_checker_and_has_one_plugin_node_per_op(engine):
    _, out = engine
    graph = check_onnx(out / "rank0.onnx")  # full_check + strict shape inference, raises on failure
    k3_nodes = [n for n in graph.graph.node if n.domain == DOMAIN]
    cfg = load_model(engine[0], dtype=torch.float32).config
    # prefill forms only: one KDA node per KDA layer, one MLA node per MLA layer, one MoE per MoE layer
    counts = {op: sum(n.op_type == op for n in k3_nodes) for op in {n.op_type for n in k3_nodes}}
    assert counts == {"K3KdaPrefill": len(cfg.kda_layer_indices), "K3MlaPrefill": len(cfg.mla_layer_indices),
                      "K3SituMoeMxfp4": sum(p.ffn != "dense" for p in cfg.layers)}
    by_plugin = {c.plugin: c for c in ALL_CONTRACTS}
    for node in k3_nodes:
        attrs = {a.name: a for a in node.attribute}
        assert onnx.helper.get_attribute_value(attrs.pop("plugin_version")) == b"1"
        assert onnx.helper.get_attribute_value(attrs.pop("plugin_namespace")) == b"k3"
        contract = by_plugin[node.op_type]
        assert sorted(attrs) == sorted(a.name for a in contract.attrs)
        for a in contract.attrs:
            assert attrs[a.name].type == (onnx.AttributeProto.INT if a.kind == "int" else onnx.AttributeProto.FLOAT)
    # every shape is known to the checker, weights live outside the graph file
    assert (out / "rank0.onnx.data").stat().st_size > (out / "rank0.onnx").stat().st_size
    assert not any(n.metadata_props for n in graph.graph.node)


def test_mxfp4_weights_are_the_checkpoint_bytes_viewed_as_int8(engine):
    """TensorRT-RTX's ONNX parser widens UINT8 weights to INT32, so the graph carries the
    contract's uint8 inputs as INT8 initializers holding exactly the checkpoint's bytes."""
    ckpt, out = engine
    graph = onnx.load(str(out / "rank0.onnx"))
    weights = {w.name: w for w in graph.graph.initializer}
    byte_buffers = {f"model.{n}": b for n, b in load_model(ckpt, dtype=torch.float32).named_buffers()
                    if b.dtype == torch.uint8}
    fed = {node.input[i] for node in graph.graph.node if node.domain == DOMAIN
           for i, t in enumerate({c.plugin: c for c in ALL_CONTRACTS}[node.op_type].inputs) if t.dtype == "uint8"}
    assert fed == set(byte_buffers) and fed
    for name, buffer in byte_buffers.items():
        assert weights[name].data_type == onnx.TensorProto.INT8, name
        stored = onnx.numpy_helper.to_array(weights[name])
        assert torch.equal(torch.from_numpy(stored.view("uint8")), buffer), name


def test_graph_io_is_the_step_contract_and_the_build_config(engine):
    ckpt, out = engine
    graph = onnx.load(str(out / "rank0.onnx"), load_external_data=False)
    config = json.loads((out / "config.json").read_text())
    cfg = load_model(ckpt, dtype=torch.float32).config
    inputs, outputs = engine_inputs(cfg, torch.float32, BS), engine_outputs(cfg, torch.float32, BS)
    assert [i.name for i in graph.graph.input] == [t.name for t in inputs]
    assert [o.name for o in graph.graph.output] == [t.name for t in outputs]
    int32 = onnx.TensorProto.INT32
    for vi, t in zip(graph.graph.input, inputs):
        dims = [d.dim_value if d.HasField("dim_value") else "dyn" for d in vi.type.tensor_type.shape.dim]
        assert dims == [d if isinstance(d, int) else "dyn" for d in t.shape], t.name
        if not t.pool:
            assert vi.type.tensor_type.elem_type == int32, t.name
    # what an executor binds by name: the config's I/O lists are the graph's, in order
    assert [t["name"] for t in config["inputs"]] == [i.name for i in graph.graph.input]
    assert [t["name"] for t in config["outputs"]] == [o.name for o in graph.graph.output]
    # each pool is an input and, as its `_out` alias, an output (bound to the same buffer)
    pools = [t["name"] for t in config["inputs"] if "pool" in t]
    assert pools == [t.name for t in inputs if t.pool]
    # a KDA layer's state pools and its snapshot pools (which the step graph binds and never writes)
    assert len(pools) == len(cfg.mla_layer_indices) + 4 * len(cfg.kda_layer_indices)
    assert config["aliases"] == {name: f"{name}_out" for name in pools}
    assert [o.name for o in graph.graph.output][1:] == [f"{name}_out" for name in pools]


def test_cpu_execution_of_the_graph_equals_the_torch_model(engine):
    """A mixed prefill step, then decode steps, then a step mixing decode with a new prompt;
    the graph (reference evaluator + reference k3 ops) and the torch model each carry their
    own pools through all steps. Tolerance 2e-4 abs on logits of magnitude ~10 and on the
    pools: fp32 everywhere, the only differences are summation orders of numpy vs torch
    matmuls over 10 layers."""
    ckpt, out = engine
    model = load_model(ckpt, dtype=torch.float32)
    inputs = engine_inputs(model.config, torch.float32, BS)
    pools = [t for t in inputs if t.pool]
    graph = CpuStepGraph(out / "rank0.onnx", inputs)
    ref, onx = model.allocate_caches(8, BS, 3), model.allocate_caches(8, BS, 3)
    batches = [
        [(list(range(3, 21)), 0, 0, [0, 1]), (list(range(40, 45)), 0, 2, [2])],
        [([7], 18, 0, [0, 1]), ([9], 5, 2, [2])],
        [([8], 19, 0, [0, 1]), ([10], 6, 2, [2])],
        [([11], 20, 0, [0, 1]), ([4, 5, 6], 0, 1, [3]), ([12], 7, 2, [2])],
    ]
    steps = [build_step(seqs, BS) for seqs in batches]
    for i, step in enumerate(steps):
        expected = model(step, ref, decode=False)
        got = graph.run(flatten_step(step), [pool_tensor(onx, p) for p in pools])
        torch.testing.assert_close(got[0], expected, rtol=0, atol=2e-4, msg=f"logits of step {i}")
        for p, new in zip(pools, got[1:]):
            pool_tensor(onx, p).copy_(new)
            torch.testing.assert_close(new, pool_tensor(ref, p), rtol=0, atol=2e-4, msg=f"{p.name} after step {i}")
    # the decode steps' logits also match the model's own decode forms (recurrent KDA, absorbed MLA)
    decode_ref = model.allocate_caches(8, BS, 3)
    for i, step in enumerate(steps[:3]):
        before = [pool_tensor(decode_ref, p).clone() for p in pools]
        logits = model(step, decode_ref, decode=is_pure_decode(batches[i]))
        if i:
            assert is_pure_decode(batches[i])
            graph_logits = graph.run(flatten_step(step), before)[0]
            # chunked vs recurrent KDA and expanded vs absorbed MLA differ by summation order only
            torch.testing.assert_close(graph_logits, logits, rtol=0, atol=1e-3)


@NEEDS_RTX
def test_tensorrt_rtx_builds_a_plan_with_two_profiles(engine):
    _, out = engine
    config = json.loads((out / "config.json").read_text())
    assert config["ranks"][0]["plan"] == "rank0.plan"
    assert (out / "rank0.plan").stat().st_size > 1 << 20
    assert config["profiles"]["order"] == ["prefill", "decode"]
    decode, prefill = config["profiles"]["decode"], config["profiles"]["prefill"]
    assert decode["input_ids"] == [[1], [4], [4]] and prefill["input_ids"][2] == [64]
    assert config["builder"]["module"] == "tensorrt_rtx_bindings"
    assert {p["name"] for p in config["plugins"]} == {"K3KdaPrefill", "K3MlaPrefill", "K3SituMoeMxfp4"}


@NEEDS_RTX
def test_builder_names_a_byte_weight_typed_otherwise_after_parsing(engine, tmp_path):
    """The same bytes as UINT8 initializers, which TensorRT-RTX 1.7's parser widens to INT32:
    the build stops before the builder (a Python plugin offered no usable type aborts the
    process) and names the input."""
    from k3_trtllm.trt.bindings import import_tensorrt

    _, out = engine
    graph = onnx.load(str(out / "rank0.onnx"))
    for w in graph.graph.initializer:
        if w.data_type == onnx.TensorProto.INT8:
            w.data_type = onnx.TensorProto.UINT8  # raw_data unchanged: the same bytes
    onnx.save(graph, str(tmp_path / "uint8.onnx"), save_as_external_data=True, location="uint8.onnx.data")
    profiles = json.loads((out / "config.json").read_text())["profiles"]
    with pytest.raises(PlanBuildError, match=r"K3SituMoeMxfp4 .*input w13_packed .* the plugin takes DataType.INT8"):
        build_plan(import_tensorrt("tensorrt-rtx"), tmp_path / "uint8.onnx", profiles, log=lambda msg: None)
