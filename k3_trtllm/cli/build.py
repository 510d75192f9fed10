"""``k3-trt build CKPT_DIR OUT_DIR``: ONNX graph per rank with K3 plugin nodes, a TensorRT
plan when a builder and the plugins are available, and the build config."""
from __future__ import annotations

import sys

import click
import torch

_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


@click.command()
@click.argument("checkpoint", type=click.Path(file_okay=False))
@click.argument("out_dir", type=click.Path(file_okay=False))
@click.option("--max-batch-size", default=8, show_default=True, help="sequences per step")
@click.option("--max-num-tokens", default=512, show_default=True, help="tokens per step (prefill chunks + decodes)")
@click.option("--max-seq-len", default=2048, show_default=True, help="tokens per sequence, context included")
@click.option("--block-size", default=64, show_default=True, help="tokens per latent-cache block")
@click.option("--plugin-lib", type=click.Path(dir_okay=False), default=None,
              help="libk3_trt_plugins.so (build_scripts/build_plugins.sh); without it no plan is built")
@click.option("--builder", type=click.Choice(["auto", "tensorrt", "tensorrt-rtx", "none"]), default="auto",
              show_default=True, help="auto: tensorrt, else tensorrt-rtx, else ONNX only")
@click.option("--dtype", type=click.Choice(sorted(_DTYPES)), default="bfloat16", show_default=True,
              help="activation and cache dtype of the engine (float32 for CPU checks)")
@click.option("--force", is_flag=True, help="replace OUT_DIR if it exists")
def build(checkpoint, out_dir, max_batch_size, max_num_tokens, max_seq_len, block_size, plugin_lib, builder,
          dtype, force) -> None:
    """Build an engine dir from a K3 checkpoint (HF or converted, world size 1)."""
    from ..checkpoint.hf import CheckpointError
    from ..config import ConfigError
    from ..export.engine_dir import build_engine_dir
    from ..trt.bindings import BuilderUnavailable
    from ..trt.builder import PlanBuildError
    from ..trt.profiles import BuildLimits

    limits = BuildLimits(max_batch_size, max_num_tokens, max_seq_len, block_size)
    try:
        build_engine_dir(checkpoint, out_dir, limits, dtype=_DTYPES[dtype], builder=builder,
                         plugin_lib=plugin_lib, force=force)
    except (CheckpointError, ConfigError, BuilderUnavailable, PlanBuildError, FileNotFoundError,
            FileExistsError, ValueError, RuntimeError) as e:
        click.echo(f"k3-trt build: error: {e}", err=True)
        sys.exit(1)
