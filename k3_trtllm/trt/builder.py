"""ONNX -> TensorRT(-RTX) plan through the ONNX parser (DESIGN §6): load the plugin
library, parse, one optimisation profile per phase, ``build_serialized_network``; and
``open_builder``, which says before any slow work whether a plan can be built at all."""
from __future__ import annotations

import ctypes
import sys
from pathlib import Path
from types import ModuleType

from ..export.schemas import BYTES_CONTRACT_DTYPE, BYTES_TRT_TYPE
from ..ops.contract import ALL_CONTRACTS, PLUGIN_NAMESPACE, PLUGIN_VERSION
from .profiles import DECODE, PREFILL

PROFILE_ORDER = (PREFILL, DECODE)  # profile index 0 and 1 in the plan


class PlanBuildError(RuntimeError):
    pass


def load_plugin_library(trt: ModuleType, path: str | Path) -> None:
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"plugin library {path} not found: run build_scripts/build_plugins.sh")
    # load_library needs the exported getCreators and setLoggerFinder; it returns None on failure
    if trt.get_plugin_registry().load_library(str(path)) is None:
        raise PlanBuildError(f"{trt.__name__} cannot load the plugin library {path}: {_load_failure(path)}")


def _load_failure(path: Path) -> str:
    """Why a plugin library did not load: TensorRT only says that it did not; the dynamic
    loader names a bad file or a missing dependency, the symbol table a non-plugin library."""
    try:
        lib = ctypes.CDLL(str(path))
    except OSError as e:
        return str(e)
    if not hasattr(lib, "getCreators") and not hasattr(lib, "getPluginCreators"):
        return "it exports no getCreators: not a TensorRT plugin library (build_scripts/build_plugins.sh builds one)"
    if not hasattr(lib, "setLoggerFinder"):
        return "it exports no setLoggerFinder, which TensorRT requires of a plugin library"
    return "the library opens, but TensorRT refused it (see TensorRT's messages above)"


def missing_creators(trt: ModuleType, plugins: list[str]) -> list[str]:
    """The K3 plugins of ``plugins`` that the plugin registry has no creator for."""
    registry = trt.get_plugin_registry()
    return [p for p in plugins if registry.get_creator(p, PLUGIN_VERSION, PLUGIN_NAMESPACE) is None]


def open_builder(which: str, plugin_lib: str | Path | None, plugins: list[str], log=None) -> ModuleType | None:
    """The TensorRT module a plan of a graph holding ``plugins`` will be built with, checked
    before the (slow) export: its bindings import, it creates a builder here, ``plugin_lib``
    loads and every plugin has a creator. With ``which`` "auto" and no plugin library, a plan
    that cannot be built is skipped (None, the reason logged); an explicit builder or a plugin
    library says the user wants a plan, so there the reason is raised."""
    from .bindings import BuilderUnavailable, import_tensorrt

    log = log or (lambda msg: print(msg, file=sys.stderr))
    if which == "none":
        return None
    strict = which != "auto" or plugin_lib is not None
    try:
        trt = import_tensorrt(which)
        _probe_builder(trt)
    except BuilderUnavailable as e:
        if strict:
            raise
        log(f"build: no plan ({e})")
        return None
    if plugin_lib is not None:
        load_plugin_library(trt, plugin_lib)
    missing = missing_creators(trt, plugins)
    if not missing:
        return trt
    why = (f"the plugin library {plugin_lib} does not register them" if plugin_lib is not None else
           "pass --plugin-lib with the K3 plugin library (build_scripts/build_plugins.sh builds it)")
    reason = (f"{trt.__name__} has no plugin creator for {', '.join(missing)} (namespace {PLUGIN_NAMESPACE!r}, "
              f"version {PLUGIN_VERSION!r}): {why}")
    if strict:
        raise PlanBuildError(reason)
    log(f"build: no plan ({reason})")
    return None


def _probe_builder(trt: ModuleType) -> None:
    from .bindings import BuilderUnavailable

    try:
        builder = trt.Builder(trt.Logger(trt.Logger.ERROR))
    except Exception as e:  # the bindings raise whatever their C++ side threw (no GPU, no driver)
        raise BuilderUnavailable(f"{trt.__name__} {trt.__version__} cannot create a builder here: {e}") from e
    if builder is None:
        raise BuilderUnavailable(f"{trt.__name__} {trt.__version__} cannot create a builder here")


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
    builder, network, config, _logger = _parsed_network(trt, onnx_path, profiles, log)
    plan = builder.build_serialized_network(network, config)
    if plan is None:
        raise PlanBuildError("build_serialized_network failed (see the TensorRT messages above)")
    return bytes(plan)


def write_plan(trt: ModuleType, onnx_path: str | Path, profiles: dict[str, dict[str, list[list[int]]]],
               path: str | Path, log=None) -> int:
    """``build_plan`` straight into ``path`` through TensorRT's ``IStreamWriter``: the plan is
    never held in memory whole. Returns its size in bytes."""
    log = log or (lambda msg: print(msg, file=sys.stderr))
    builder, network, config, _logger = _parsed_network(trt, onnx_path, profiles, log)

    class _FileWriter(trt.IStreamWriter):
        def __init__(self, f):
            trt.IStreamWriter.__init__(self)
            self.f, self.size = f, 0

        def write(self, data) -> int:
            n = self.f.write(data)
            self.size += n
            return n

    with open(path, "wb") as f:
        writer = _FileWriter(f)
        if not builder.build_serialized_network_to_stream(network, config, writer):
            raise PlanBuildError("build_serialized_network_to_stream failed (see the TensorRT messages above)")
    return writer.size


def _parsed_network(trt: ModuleType, onnx_path, profiles, log):
    """Builder, parsed network and builder config with the two profiles (and the logger,
    which must outlive them)."""
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
    return builder, network, config, logger
