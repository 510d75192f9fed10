"""ONNX -> TensorRT(-RTX) plan through the ONNX parser (DESIGN §6): load the plugin
library, parse, one optimisation profile per phase, ``build_serialized_network``."""
from __future__ import annotations

import sys
from pathlib import Path
from types import ModuleType

from ..export.schemas import BYTES_CONTRACT_DTYPE, BYTES_TRT_TYPE
from ..ops.contract import ALL_CONTRACTS, PLUGIN_NAMESPACE
from .profiles import DECODE, PREFILL

PROFILE_ORDER = (PREFILL, DECODE)  # profile index 0 and 1 in the plan


class PlanBuildError(RuntimeError):
    pass


def load_plugin_library(trt: ModuleType, path: str | Path) -> None:
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"plugin library {path} not found: run build_scripts/build_plugins.sh")
    # load_library needs the exported getCreators and setLoggerFinder
    trt.get_plugin_registry().load_library(str(path))


def fixed_input_types(trt: ModuleType) -> dict:
    """Contract dtype -> the one TensorRT type a K3 plugin takes for it ("act" is free)."""
    return {"fp32": trt.DataType.FLOAT, "int32": trt.DataType.INT32,
            BYTES_CONTRACT_DTYPE: getattr(trt.DataType, BYTES_TRT_TYPE)}


def check_plugin_input_types(trt: ModuleType, network) -> None:
    """Names a K3 plugin input the parser typed differently from the contract (e.g. a UINT8
    weight widened to INT32); the builder would only say that no format is supported, and
    with Python plugins the process aborts."""
    contracts = {c.plugin: c for c in ALL_CONTRACTS}
    fixed = fixed_input_types(trt)
    for i in range(network.num_layers):
        layer = network.get_layer(i)
        if layer.type != trt.LayerType.PLUGIN_V3:
            continue
        layer.__class__ = trt.IPluginV3Layer  # the bindings' downcast
        core = layer.plugin.get_capability_interface(trt.PluginCapabilityType.CORE)
        contract = contracts.get(core.plugin_name) if core.plugin_namespace == PLUGIN_NAMESPACE else None
        for k, spec in enumerate(contract.inputs if contract is not None else ()):
            got = layer.get_input(k).dtype
            if spec.dtype in fixed and got != fixed[spec.dtype]:
                raise PlanBuildError(f"{contract.plugin} {layer.name}: input {spec.name} ({layer.get_input(k).name}) "
                                     f"is {got} after parsing, the plugin takes {fixed[spec.dtype]}")


def build_plan(trt: ModuleType, onnx_path: str | Path, profiles: dict[str, dict[str, list[list[int]]]],
               log=None) -> bytes:
    """``profiles``: phase -> input name -> [min, opt, max] shapes. Plugins must already be
    registered (``load_plugin_library`` or Python creators)."""
    log = log or (lambda msg: print(msg, file=sys.stderr))
    logger = trt.Logger(trt.Logger.WARNING)
    builder = trt.Builder(logger)
    # precision comes from the graph's tensor types (RTX has no precision flags)
    network = builder.create_network(1 << int(trt.NetworkDefinitionCreationFlag.STRONGLY_TYPED))
    parser = trt.OnnxParser(network, logger)
    log(f"build: parsing {Path(onnx_path).name}")
    if not parser.parse_from_file(str(onnx_path)):
        errors = "; ".join(str(parser.get_error(i)) for i in range(parser.num_errors))
        raise PlanBuildError(f"ONNX parser rejected {onnx_path}: {errors}")
    check_plugin_input_types(trt, network)
    config = builder.create_builder_config()
    names = {network.get_input(i).name for i in range(network.num_inputs)}
    for phase in PROFILE_ORDER:
        shapes = profiles[phase]
        if set(shapes) != names:
            raise PlanBuildError(f"profile {phase} names {sorted(set(shapes) ^ names)} that the network "
                                 "does not have, or misses them")
        profile = builder.create_optimization_profile()
        for name, (lo, opt, hi) in shapes.items():
            profile.set_shape(name, lo, opt, hi)
        config.add_optimization_profile(profile)
    log(f"build: {network.num_layers} layers, profiles {', '.join(PROFILE_ORDER)}")
    plan = builder.build_serialized_network(network, config)
    if plan is None:
        raise PlanBuildError("build_serialized_network failed (see the TensorRT messages above)")
    return bytes(plan)
