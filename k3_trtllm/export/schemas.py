"""``onnx.defs.OpSchema`` for every K3 op in domain ``k3``, generated from the contracts.

Registering them before export makes ``onnx.checker.check_model(full_check=True)`` validate
the custom nodes (input counts, types, attributes) instead of skipping them, and gives
strict shape inference a function for each node's outputs. The node is the functional
twin of the op: the contract's outputs, then each mutated pool as ``<name>_out``."""
from __future__ import annotations

import onnx
from onnx import defs, shape_inference

from ..ops.contract import ALL_CONTRACTS, PLUGIN_NAMESPACE, PLUGIN_VERSION, OpContract, TensorSpec

DOMAIN = "k3"
DOMAIN_VERSION = 1

# Contract dtype "uint8" (packed MXFP4 codes, E8M0 scales) is carried by the graph and by
# TensorRT as INT8, a bit-identical view of the same bytes: TensorRT-RTX 1.7's ONNX parser
# widens UINT8 initializers to INT32 (4x the memory, values no kernel reads) but keeps INT8
# ones. The reference ops and the CUDA kernels read the bytes as uint8 again.
BYTES_CONTRACT_DTYPE = "uint8"
BYTES_ONNX_TYPE = onnx.TensorProto.INT8
BYTES_TRT_TYPE = "INT8"  # trt.DataType.INT8 / nvinfer1::DataType::kINT8

# Dtype tag of the contract -> (type-constraint name, allowed ONNX tensor types).
# "act" admits fp32/fp64 besides bf16/fp16 because the reference model exports in any dtype.
_TYPE_CONSTRAINTS = {
    "act": ("T_act", ("tensor(bfloat16)", "tensor(float16)", "tensor(float)", "tensor(double)")),
    "fp32": ("T_f32", ("tensor(float)", "tensor(double)")),
    "int32": ("T_i32", ("tensor(int32)",)),
    BYTES_CONTRACT_DTYPE: ("T_u8", (f"tensor({onnx.TensorProto.DataType.Name(BYTES_ONNX_TYPE).lower()})",)),
}
_ATTR_TYPES = {"int": defs.OpSchema.AttrType.INT, "float": defs.OpSchema.AttrType.FLOAT}


def node_outputs(contract: OpContract) -> tuple[TensorSpec, ...]:
    """Outputs of the ONNX node and of the TensorRT plugin, in order."""
    pools = tuple(TensorSpec(f"{t.name}_out", t.dtype, t.shape, doc=f"{t.name} after the step")
                  for t in contract.mutated_inputs)
    return contract.outputs + pools


def _param(t: TensorSpec) -> defs.OpSchema.FormalParameter:
    return defs.OpSchema.FormalParameter(t.name, _TYPE_CONSTRAINTS[t.dtype][0], t.doc)


def _bind_symbols(contract: OpContract, ctx) -> dict[str, onnx.TensorShapeProto.Dimension]:
    """Symbol of the contract shape -> the input dimension carrying it (first occurrence)."""
    bound: dict[str, onnx.TensorShapeProto.Dimension] = {}
    for i, spec in enumerate(contract.inputs):
        t = ctx.get_input_type(i)
        if t is None or not t.tensor_type.HasField("shape"):
            continue
        dims = t.tensor_type.shape.dim
        if len(dims) != len(spec.shape):
            raise shape_inference.InferenceError(
                f"{contract.plugin}: input {spec.name} has rank {len(dims)}, expected {len(spec.shape)}")
        for sym, d in zip(spec.shape, dims):
            bound.setdefault(sym, d)
    return bound


def _output_dim(sym: str, bound) -> onnx.TensorShapeProto.Dimension:
    d = onnx.TensorShapeProto.Dimension()
    if sym in bound:
        d.CopyFrom(bound[sym])
        return d
    # products such as "H*Dv": computable when every factor is a known number
    values = [bound.get(f) for f in sym.split("*")]
    if all(v is not None and v.HasField("dim_value") for v in values):
        prod = 1
        for v in values:
            prod *= v.dim_value
        d.dim_value = prod
    return d


def _make_inference(contract: OpContract):
    outputs = node_outputs(contract)

    def infer(ctx) -> None:
        bound = _bind_symbols(contract, ctx)
        for j, spec in enumerate(outputs):
            donor = next(i for i, t in enumerate(contract.inputs) if t.dtype == spec.dtype)
            src = ctx.get_input_type(donor)
            out = onnx.TypeProto()
            out.tensor_type.elem_type = src.tensor_type.elem_type
            for sym in spec.shape:
                out.tensor_type.shape.dim.append(_output_dim(sym, bound))
            ctx.set_output_type(j, out)

    return infer


def op_schema(contract: OpContract) -> defs.OpSchema:
    used = sorted({t.dtype for t in contract.inputs}, key=list(_TYPE_CONSTRAINTS).index)
    attrs = [defs.OpSchema.Attribute(a.name, _ATTR_TYPES[a.kind], a.doc) for a in contract.attrs]
    attrs += [
        defs.OpSchema.Attribute("plugin_version", onnx.helper.make_attribute("plugin_version", PLUGIN_VERSION),
                                "TensorRT plugin version"),
        defs.OpSchema.Attribute("plugin_namespace", onnx.helper.make_attribute("plugin_namespace", PLUGIN_NAMESPACE),
                                "TensorRT plugin namespace"),
    ]
    schema = defs.OpSchema(
        contract.plugin, DOMAIN, DOMAIN_VERSION, contract.doc,
        inputs=[_param(t) for t in contract.inputs],
        outputs=[_param(t) for t in node_outputs(contract)],
        type_constraints=[(_TYPE_CONSTRAINTS[k][0], list(_TYPE_CONSTRAINTS[k][1]), k) for k in used],
        attributes=attrs,
    )
    schema.set_type_and_shape_inference_function(_make_inference(contract))
    return schema


def register_schemas() -> None:
    """Idempotent: registers the k3 schemas once per process."""
    for contract in ALL_CONTRACTS:
        if not defs.has(contract.plugin, DOMAIN):
            defs.register_schema(op_schema(contract))
