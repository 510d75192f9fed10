"""ONNX -> TensorRT(-RTX) plan through the ONNX parser (DESIGN §6): load the plugin
library, parse, one optimisation profile per phase, ``build_serialized_network``."""
from __future__ import annotations

import sys
from pathlib import Path
from types import ModuleType

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
