"""torch model -> ONNX graph of one engine step, K3 ops as ``k3`` plugin nodes (DESIGN §9).

The graph takes the step tensors and the cache pools (``engine_io``) and returns the
logits and the updated pools. Dynamic dims: tokens, sequences, logits rows, block-table
width, pool blocks and state slots. The prefill forms of the ops are exported (the phase is
fixed at export, ``StepGraph(decode=False)``); they are exact for decode tokens too, and
their kernels pick their decode paths from the input extents (KDA: as many tokens as
sequences; MLA: the absorbed form below a few tokens per sequence), so one graph serves both
profiles and the runtime's phase picks only the profile."""
from __future__ import annotations

import sys
from pathlib import Path

import onnx
import onnx_ir as ir
import torch
from torch.export import Dim

from ..model.step import build_step
from ..model.caches import is_fp8_cache
from ..ops.contract import ALL_CONTRACTS, KDA_PREFILL, MLA_PREFILL, MLA_PREFILL_FP8, SITU_MOE, SITU_MOE_MXFP4
from .engine_io import (LOGITS, MAX_BLOCKS, MAX_SLOTS, NUM_BLOCKS, SEQS, SEQS_PLUS_1, SNAPSHOT_SLOTS, TOKENS,
                        TensorIO, engine_inputs, engine_outputs, flatten_step, pool_tensor)
from .schemas import BYTES_CONTRACT_DTYPE, BYTES_ONNX_TYPE, DOMAIN, DOMAIN_VERSION, register_schemas
from .step_graph import StepGraph
from .translations import translation_table

OPSET = 22  # pinned: 23 turns on onnxscript fusions into Attention/RMSNormalization nodes


def graph_plugins(cfg, kv_cache_dtype: str = "auto", act: torch.dtype = torch.bfloat16) -> list[str]:
    """The plugins the exported graph of ``cfg`` holds, known before exporting it: the
    prefill form of each layer's attention (MLA's over the fp8 cache for ``kv_cache_dtype``
    fp8), and of the routed MoE where a layer has one."""
    mla = MLA_PREFILL_FP8 if is_fp8_cache(kv_cache_dtype, act) else MLA_PREFILL
    found = set()
    for layer in cfg.layers:
        found.add((KDA_PREFILL if layer.attention == "kda" else mla).plugin)
        if layer.ffn == "moe":
            found.add((SITU_MOE_MXFP4 if cfg.moe.mxfp4 else SITU_MOE).plugin)
    return sorted(found)


def _sample_inputs(model, block_size: int, kv_cache_dtype: str) -> list[torch.Tensor]:
    """A step whose dynamic sizes all differ from each other and from 0/1 (torch.export
    would otherwise specialise or unify them): 3 sequences, 7 tokens, 2 logits rows,
    tables of 5 blocks, 11 pool blocks, 6 state slots, 10 snapshot rows."""
    seqs = [([1, 1, 1], 0, 0, [0, 1, 2, 3, 4]), ([1, 1], 4, 1, [5, 6]), ([1, 1], 0, 2, [7])]
    step = build_step(seqs, block_size)
    step.logits_indices = step.logits_indices[1:]
    caches = model.allocate_caches(num_blocks=11, block_size=block_size, max_slots=6, kv_cache_dtype=kv_cache_dtype)
    caches.allocate_snapshots(10)
    pools = [t for t in engine_inputs(model.config, model.dtype, block_size, kv_cache_dtype) if t.pool]
    return flatten_step(step) + [pool_tensor(caches, p) for p in pools]


def _dynamic_shapes(inputs: tuple[TensorIO, ...]):
    dims = {TOKENS: Dim("num_tokens", min=1), SEQS: Dim("num_seqs", min=1), LOGITS: Dim("num_logits", min=1),
            MAX_BLOCKS: Dim("max_blocks", min=1), NUM_BLOCKS: Dim("num_blocks", min=1),
            MAX_SLOTS: Dim("max_slots", min=1), SNAPSHOT_SLOTS: Dim("snapshot_slots", min=1)}
    dims[SEQS_PLUS_1] = dims[SEQS] + 1
    return tuple({axis: dims[d] for axis, d in enumerate(t.shape) if isinstance(d, str)} for t in inputs)


def _strip_metadata(ir_model) -> None:
    """Stack traces with absolute paths are most of the graph's bytes and leak local paths."""
    for node in ir_model.graph.all_nodes():
        node.metadata_props.clear()
    graph = ir_model.graph
    for value in [*graph.inputs, *graph.outputs, *graph.initializers.values()]:
        value.metadata_props.clear()
    ir_model.graph.metadata_props.clear()
    ir_model.metadata_props.clear()


def _bytes_slots() -> dict[str, set[int]]:
    """Plugin -> indices of its contract-"uint8" inputs."""
    return {c.plugin: {i for i, t in enumerate(c.inputs) if t.dtype == BYTES_CONTRACT_DTYPE} for c in ALL_CONTRACTS}


def _retype_byte_weights(ir_model) -> None:
    """Give the weights feeding contract-"uint8" inputs the graph's byte type (``schemas.BYTES_ONNX_TYPE``),
    a view of the same bytes. Done on the exported model because the translations see those
    weights as lifted graph inputs, and ONNX has no bit cast a translation could insert."""
    slots = _bytes_slots()
    byte_type = ir.DataType(BYTES_ONNX_TYPE)
    for node in ir_model.graph.all_nodes():
        for i in slots.get(node.op_type, ()) if node.domain == DOMAIN else ():
            value = node.inputs[i]
            if value.dtype == byte_type:
                continue  # a weight shared with an earlier node
            if value.const_value is None or not value.is_initializer():
                raise ValueError(f"{node.op_type}: input {i} ({value.name}) must be a weight, got a computed tensor")
            users = [(u.node.domain, u.node.op_type, u.idx) for u in value.uses()]
            if any(d != DOMAIN or idx not in slots.get(op, ()) for d, op, idx in users):
                raise ValueError(f"{value.name} feeds nodes other than plugin byte inputs: {users}")
            data = value.const_value.numpy().view(byte_type.numpy())
            value.const_value = ir.Tensor(data, name=value.name)
            value.type = ir.TensorType(byte_type)


def _retype_byte_graph_io(ir_model) -> None:
    """Graph inputs feeding contract-"uint8" plugin inputs (weights of a weightless graph, the
    fp8 latent pools) and graph outputs that plugins write as bytes (the updated fp8 pools)
    become INT8, the same bytes (``schemas.BYTES_ONNX_TYPE``), as the plugin schemas require."""
    slots = _bytes_slots()
    byte_type = ir.DataType(BYTES_ONNX_TYPE)
    for value in ir_model.graph.inputs:
        if value.dtype != ir.DataType.UINT8 or value.is_initializer():  # weights: _retype_byte_weights
            continue
        users = [(u.node.domain, u.node.op_type, u.idx) for u in value.uses()]
        if not users or any(d != DOMAIN or idx not in slots.get(op, ()) for d, op, idx in users):
            raise ValueError(f"{value.name}: a uint8 input must feed plugin byte inputs only, feeds {users}")
        value.type = ir.TensorType(byte_type)
    for value in ir_model.graph.outputs:
        if value.dtype != ir.DataType.UINT8:
            continue
        node = value.producer()
        if node is None or node.domain != DOMAIN:
            raise ValueError(f"{value.name}: a uint8 output must be written by a plugin, comes from "
                             f"{'a graph input' if node is None else node.op_type}")
        value.type = ir.TensorType(byte_type)


def export_step_onnx(model, path: str | Path, block_size: int, log=None, kv_cache_dtype: str = "auto") -> Path:
    """Export ``model`` to ``path`` (+ ``path.data`` external weights); returns ``path``.
    ``kv_cache_dtype`` fp8: the latent pools are the fp8 rows and the MLA nodes their ops."""
    log = log or (lambda msg: print(msg, file=sys.stderr))
    register_schemas()
    path = Path(path)
    cfg, act = model.config, model.dtype
    inputs = engine_inputs(cfg, act, block_size, kv_cache_dtype)
    outputs = engine_outputs(cfg, act, block_size, kv_cache_dtype)
    # the prefill forms serve both profiles (module doc): the phase is fixed here, at export
    graph = StepGraph(model, tuple(t for t in inputs if t.pool), block_size, decode=False).eval()
    args = tuple(_sample_inputs(model, block_size, kv_cache_dtype))
    log(f"export: tracing {cfg.num_hidden_layers} layers ({len(inputs)} inputs, {len(outputs)} outputs)")
    with torch.no_grad():
        program = torch.onnx.export(
            graph, args, dynamo=True, opset_version=OPSET, optimize=True,
            input_names=[t.name for t in inputs], output_names=[t.name for t in outputs],
            dynamic_shapes=(_dynamic_shapes(inputs),), custom_translation_table=translation_table(),
            verbose=False,
        )
    _strip_metadata(program.model)
    _retype_byte_graph_io(program.model)  # first: the weights' retype takes INT8 graph inputs for done
    _retype_byte_weights(program.model)
    program.model.opset_imports[DOMAIN] = DOMAIN_VERSION
    path.parent.mkdir(parents=True, exist_ok=True)
    program.save(str(path), external_data=True)
    log(f"export: wrote {path.name} (+ {path.name}.data)")
    return path


def check_onnx(path: str | Path) -> onnx.ModelProto:
    """``check_model(full_check=True)`` and strict shape inference, path-based (over 2 GB
    the in-memory proto cannot be serialised); returns the inferred model without weights."""
    register_schemas()
    path = Path(path)
    onnx.checker.check_model(str(path), full_check=True)
    inferred = path.with_name(path.stem + ".inferred.onnx")
    try:
        onnx.shape_inference.infer_shapes_path(str(path), str(inferred), check_type=True, strict_mode=True,
                                               data_prop=True)
        return onnx.load(str(inferred), load_external_data=False)
    finally:
        inferred.unlink(missing_ok=True)
