"""onnxscript translations of the ``k3::`` ops, generated from the contracts.

Each exported op (the functional twin ``k3::<name>_functional`` of an op that updates
caches, the op itself when it updates none) becomes one node ``k3.<Plugin>`` carrying
``plugin_version`` / ``plugin_namespace`` and the contract's attributes (the only ones
the plugin creator lists as fields). Index inputs are cast to int32 in the graph, since
a TensorRT plugin offered int64 aborts the build (DESIGN §9). The weights feeding
contract-"uint8" inputs are lifted graph inputs here; the exporter retypes them to
``schemas.BYTES_ONNX_TYPE`` afterwards (same bytes), which the schemas require."""
from __future__ import annotations

import onnxscript
import torch

from ..ops.contract import ALL_CONTRACTS, PLUGIN_NAMESPACE, PLUGIN_VERSION, OpContract
from .schemas import DOMAIN, DOMAIN_VERSION, node_outputs, register_schemas

_K3 = onnxscript.values.Opset(DOMAIN, DOMAIN_VERSION)
_ONNX = onnxscript.values.Opset("", 18)
_INT32 = 6  # onnx.TensorProto.INT32


def _attribute_values(contract: OpContract, values) -> dict:
    if len(values) != len(contract.attrs):
        raise ValueError(f"{contract.name}: expected {len(contract.attrs)} attributes, got {len(values)}")
    cast = {"int": int, "float": float}
    return {a.name: cast[a.kind](v) for a, v in zip(contract.attrs, values)}


def make_translation(contract: OpContract):
    n_in, n_out = len(contract.inputs), len(node_outputs(contract))
    index_inputs = {i for i, t in enumerate(contract.inputs) if t.dtype == "int32"}

    def translate(*args, **kwargs):
        # the exporter passes the fx node's arguments; attributes may come by keyword
        values = list(args[n_in:]) + [kwargs[a.name] for a in contract.attrs[len(args) - n_in:]]
        tensors = [_ONNX.Cast(x, to=_INT32) if i in index_inputs else x for i, x in enumerate(args[:n_in])]
        node = getattr(_K3, contract.plugin)
        return node(*tensors, plugin_version=PLUGIN_VERSION, plugin_namespace=PLUGIN_NAMESPACE,
                    _num_outputs=n_out, **_attribute_values(contract, values))

    translate.__name__ = f"k3_{contract.name}"
    return translate


def translation_table() -> dict:
    """``custom_translation_table`` for ``torch.onnx.export``; registers the schemas first
    (onnxscript looks them up while building the nodes)."""
    register_schemas()
    return {exported_op(c): make_translation(c) for c in ALL_CONTRACTS}


def exported_op(contract: OpContract):
    name = contract.functional_name if contract.mutated_inputs else contract.name
    return getattr(torch.ops.k3, name).default
