"""Python ``IPluginCreatorV3One`` creators generated from the op contracts, build phase only.

CI has TensorRT-RTX's builder but not the headers the C++ plugin library compiles against,
so CI builds plans with these: same names, version, namespace, fields, inputs, outputs,
shapes and dtypes as the C++ plugins (both follow ``contract.py``). They prove that the
exported graph and the ONNX parser agree; the builder never runs ``enqueue``, so these
plugins have no runtime and refuse to execute."""
from __future__ import annotations

import numpy as np

from k3_trtllm.export.schemas import node_outputs
from k3_trtllm.ops.contract import ALL_CONTRACTS, PLUGIN_NAMESPACE, PLUGIN_VERSION, OpContract
from k3_trtllm.trt.builder import fixed_input_types


def _act_types(trt):
    return (trt.bfloat16, trt.float16, trt.float32)


def make_plugin_classes(trt, contract: OpContract):
    outputs = node_outputs(contract)
    field_types = {"int": (trt.PluginFieldType.INT32, np.int32), "float": (trt.PluginFieldType.FLOAT32, np.float32)}
    fixed_types = fixed_input_types(trt)  # contract "uint8" is INT8, a view of the same bytes
    first_act = next(i for i, t in enumerate(contract.inputs) if t.dtype == "act")

    class Plugin(trt.IPluginV3, trt.IPluginV3OneCore, trt.IPluginV3OneBuild, trt.IPluginV3OneRuntime):
        def __init__(self, fields: dict):
            trt.IPluginV3.__init__(self)
            trt.IPluginV3OneCore.__init__(self)
            trt.IPluginV3OneBuild.__init__(self)
            trt.IPluginV3OneRuntime.__init__(self)
            self.plugin_name, self.plugin_version = contract.plugin, PLUGIN_VERSION
            self.plugin_namespace, self.num_outputs = PLUGIN_NAMESPACE, len(outputs)
            self.fields = dict(fields)

        def get_capability_interface(self, kind):
            return self

        def clone(self):
            return Plugin(self.fields)

        def get_fields_to_serialize(self):
            return trt.PluginFieldCollection([
                trt.PluginField(a.name, np.array([self.fields[a.name]], dtype=field_types[a.kind][1]),
                                field_types[a.kind][0]) for a in contract.attrs])

        def get_output_data_types(self, input_types):
            return [input_types[next(i for i, t in enumerate(contract.inputs) if t.dtype == o.dtype)]
                    for o in outputs]

        def get_output_shapes(self, inputs, shape_inputs, builder):
            bound = {}
            for spec, dims in zip(contract.inputs, inputs):
                for k, sym in enumerate(spec.shape):
                    bound.setdefault(sym, dims[k])
            result = []
            for o in outputs:
                d = trt.DimsExprs(len(o.shape))
                for k, sym in enumerate(o.shape):
                    if sym in bound:
                        d[k] = bound[sym]
                    else:  # a product of bound symbols, e.g. "H*Dv"
                        a, b = (bound[f] for f in sym.split("*"))
                        d[k] = builder.operation(trt.DimensionOperation.PROD, a, b)
                result.append(d)
            return result

        def supports_format_combination(self, pos, in_out, num_inputs):
            desc = in_out[pos].desc
            if desc.format != trt.TensorFormat.LINEAR:
                return False
            spec = contract.inputs[pos] if pos < num_inputs else outputs[pos - num_inputs]
            if spec.dtype != "act":
                return desc.type == fixed_types[spec.dtype]
            if pos == first_act:
                return desc.type in _act_types(trt)
            return desc.type == in_out[first_act].desc.type

        def configure_plugin(self, inputs, outputs_):
            pass

        def get_workspace_size(self, inputs, outputs_):
            return 0

        def on_shape_change(self, inputs, outputs_):
            pass

        def set_tactic(self, tactic):
            pass

        def attach_to_context(self, context):
            return self.clone()

        def enqueue(self, input_desc, output_desc, inputs, outputs_, workspace, stream):
            raise RuntimeError(f"{contract.plugin}: the Python creator is build-phase only; "
                               "execute plans with libk3_trt_plugins.so")

    class Creator(trt.IPluginCreatorV3One):
        def __init__(self):
            trt.IPluginCreatorV3One.__init__(self)
            self.name, self.plugin_version, self.plugin_namespace = contract.plugin, PLUGIN_VERSION, PLUGIN_NAMESPACE
            self.field_names = trt.PluginFieldCollection([
                trt.PluginField(a.name, np.array([]), field_types[a.kind][0]) for a in contract.attrs])

        def create_plugin(self, name, fc, phase):
            given = {f.name: f.data for f in fc}
            missing = [a.name for a in contract.attrs if a.name not in given]
            if missing:
                raise ValueError(f"{contract.plugin}: missing plugin fields {missing}")
            cast = {"int": int, "float": float}
            return Plugin({a.name: cast[a.kind](np.asarray(given[a.name]).reshape(-1)[0]) for a in contract.attrs})

    return Plugin, Creator


_REGISTERED: list = []  # keeps the creators alive: the registry holds borrowed references


def register_python_creators(trt) -> list[str]:
    """Register one creator per contract in namespace ``k3``; returns the plugin names."""
    registry = trt.get_plugin_registry()
    names = []
    for contract in ALL_CONTRACTS:
        if registry.get_creator(contract.plugin, PLUGIN_VERSION, PLUGIN_NAMESPACE) is None:
            _, Creator = make_plugin_classes(trt, contract)
            creator = Creator()
            registry.register_creator(creator, PLUGIN_NAMESPACE)
            _REGISTERED.append(creator)
        names.append(contract.plugin)
    return names
