"""``k3-trt build CKPT_DIR OUT_DIR``: ONNX graph per rank with K3 plugin nodes, a TensorRT
plan when a builder and the plugins are available, and the build config."""
from __future__ import annotations

import sys

import click
import torch

from ._progress import stage_progress
from .run import check_kv_cache_dtype, kv_cache_dtype_option
from ._warnings import quiet_known_build_warnings

_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
# what the `onnx` extra installs (onnx_ir comes with onnxscript)
_ONNX_MODULES = ("onnx", "onnxscript", "onnx_ir")


def _fail(message: str):
    click.echo(f"k3-trt build: error: {message}", err=True)
    sys.exit(1)


@click.command()
@click.argument("checkpoint", type=click.Path(file_okay=False), required=False)
@click.argument("out_dir", type=click.Path(file_okay=False), required=False)
@click.option("--layout", type=click.Choice(["monolithic", "segments"]), default=None,
              help="segments: one weightless graph (and plan) per segment kind for every layer and rank "
                   "(DESIGN §10); monolithic: one graph with the weights, world size 1 [default: segments with "
                   "--hf-config, else monolithic]")
@click.option("--hf-config", type=click.Path(dir_okay=False, exists=True), default=None,
              help="build segments from this config.json alone, for --tp/--ep (no checkpoint): `build --hf-config "
                   "config.json --tp 8 --ep 8 OUT_DIR`")
@click.option("--tp", type=click.IntRange(min=1), default=None, help="tensor-parallel ranks (with --hf-config)")
@click.option("--ep", type=click.IntRange(min=1), default=None, help="expert-parallel ranks (with --hf-config)")
@click.option("--max-batch-size", default=8, show_default=True, help="sequences per step")
@click.option("--max-num-tokens", default=512, show_default=True, help="tokens per step (prefill chunks + decodes)")
@click.option("--max-seq-len", default=2048, show_default=True, help="tokens per sequence, context included")
@click.option("--block-size", default=64, show_default=True, help="tokens per latent-cache block")
@click.option("--plugin-lib", type=click.Path(dir_okay=False), default=None,
              help="libk3_trt_plugins.so (build_scripts/build_plugins.sh); without it no plan is built")
@click.option("--builder", type=click.Choice(["auto", "tensorrt", "tensorrt-rtx", "none"]), default="auto",
              show_default=True, help="auto: tensorrt, else tensorrt-rtx, else ONNX only")
@click.option("--dtype", type=click.Choice(sorted(_DTYPES)), default="bfloat16", show_default=True,
              help="activation dtype of the engine, and its cache's unless --kv-cache-dtype fp8 (float32 for CPU "
                   "checks)")
@kv_cache_dtype_option()
@click.option("--force", is_flag=True, help="replace OUT_DIR if it exists and k3-trt build wrote it")
@click.option("--quiet", is_flag=True, help="no progress on stderr (errors still show)")
def build(checkpoint, out_dir, layout, hf_config, tp, ep, max_batch_size, max_num_tokens, max_seq_len, block_size,
          plugin_lib, builder, dtype, kv_cache_dtype, force, quiet) -> None:
    """Build an engine dir from a K3 checkpoint (HF or converted, world size 1)."""
    try:
        check_kv_cache_dtype(kv_cache_dtype, dtype)
    except click.ClickException as e:
        _fail(e.message)
    from ..checkpoint.hf import CheckpointError
    from ..config import ConfigError
    from ..trt.bindings import BuilderUnavailable
    from ..utils.atomic import OutputError, describe_os_error

    try:  # the exporter and the TensorRT builder module both need the onnx extra
        from ..trt.engine_dir import build_engine_dir
        from ..trt.builder import PlanBuildError
        from ..trt.profiles import BuildLimits
    except ImportError as e:
        if (e.name or "").split(".")[0] not in _ONNX_MODULES:
            raise
        _fail(f"the ONNX export needs {e.name}, which is not installed: pip install 'k3-trt[onnx]'")

    quiet_known_build_warnings()
    limits = BuildLimits(max_batch_size, max_num_tokens, max_seq_len, block_size)
    try:
        with stage_progress("build", quiet) as log:
            if layout == "segments" or (layout is None and hf_config is not None):
                _build_segments(checkpoint, out_dir, hf_config, tp, ep, limits, dtype=_DTYPES[dtype],
                                builder=builder, plugin_lib=plugin_lib, force=force, log=log,
                                kv_cache_dtype=kv_cache_dtype)
            else:
                if out_dir is None or hf_config is not None or tp is not None or ep is not None:
                    raise click.UsageError("a monolithic build takes CHECKPOINT and OUT_DIR (no --hf-config, "
                                           "--tp or --ep)")
                build_engine_dir(checkpoint, out_dir, limits, dtype=_DTYPES[dtype], builder=builder,
                                 plugin_lib=plugin_lib, force=force, log=log, kv_cache_dtype=kv_cache_dtype)
    except (CheckpointError, ConfigError, BuilderUnavailable, PlanBuildError, OutputError, ValueError,
            RuntimeError) as e:
        _fail(str(e))
    except OSError as e:  # e.g. an input that cannot be read; the output's own errors are OutputError
        _fail(describe_os_error(e))


def _build_segments(checkpoint, out_dir, hf_config, tp, ep, limits, **kwargs) -> None:
    """``build CKPT OUT --layout segments`` (the converted checkpoint's mapping) or
    ``build --hf-config config.json [--tp N --ep M] OUT`` (a world that need not exist)."""
    from ..export.segments import World
    from ..trt.segment_build import build_segmented_engine_dir

    if hf_config is not None:
        if checkpoint is None or out_dir is not None:
            raise click.UsageError("with --hf-config give OUT_DIR alone (no CHECKPOINT)")
        build_segmented_engine_dir(checkpoint, limits, hf_config=hf_config, world=World(tp or 1, ep or 1), **kwargs)
        return
    if out_dir is None:
        raise click.UsageError("give CHECKPOINT and OUT_DIR, or --hf-config and OUT_DIR")
    if tp is not None or ep is not None:
        raise click.UsageError("--tp/--ep go with --hf-config; a converted checkpoint's mapping fixes them")
    build_segmented_engine_dir(out_dir, limits, checkpoint=checkpoint, **kwargs)
