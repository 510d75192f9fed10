"""``k3-trt convert``: HF K3 checkpoint → TensorRT-LLM checkpoint (TP/EP-sharded, streaming)."""
from __future__ import annotations

import os

import click

from ..checkpoint.hf import CheckpointError
from ..config import ConfigError
from ..convert import ConvertError, convert_checkpoint
from ..convert.run import EXPERT_FORMATS
from ..utils.atomic import OutputError, describe_os_error


@click.command()
@click.argument("hf_dir", type=click.Path(file_okay=False))
@click.argument("out_dir", type=click.Path(file_okay=False))
@click.option("--tp", type=click.IntRange(min=1), default=1, show_default=True,
              help="Tensor-parallel size = world size: one rank file per rank. Splits attention heads (MLA and "
                   "KDA), dense and shared-expert intermediates and the vocabulary.")
@click.option("--ep", type=click.IntRange(min=1), default=1, show_default=True,
              help="Expert-parallel degree inside --tp (must divide it): routed experts split contiguously over "
                   "EP groups, each expert's intermediate dim over the remaining tp/ep ranks.")
@click.option("--dtype", type=click.Choice(["bfloat16"]), default="bfloat16", show_default=True,
              help="Activation/weight dtype of the converted model (K3 is bf16; fp32 tensors stay fp32).")
@click.option("--experts", type=click.Choice(EXPERT_FORMATS), default=None,
              help="Routed-expert format: keep MXFP4 packed + scales, or dequantise to bf16. Default: as stored.")
@click.option("--workers", type=click.IntRange(min=1), default=min(4, os.cpu_count() or 1), show_default=True,
              help="Pieces converted concurrently (memory grows by ~32 MiB-chunks per worker).")
@click.option("--force", is_flag=True, help="Replace OUT_DIR if it exists and k3-trt convert wrote it.")
@click.option("--quiet", is_flag=True, help="No progress bar or summary on stderr.")
def convert(hf_dir: str, out_dir: str, tp: int, ep: int, dtype: str, experts: str | None, workers: int,
            force: bool, quiet: bool) -> None:
    """Convert the HF K3 checkpoint HF_DIR into a TensorRT-LLM checkpoint OUT_DIR
    (config.json + rank{N}.safetensors). The output appears whole or not at all."""
    try:
        result = convert_checkpoint(hf_dir, out_dir, tp=tp, ep=ep, experts=experts, dtype=dtype, workers=workers,
                                    force=force, progress=not quiet)
    except (ConfigError, CheckpointError, ConvertError, OutputError) as e:
        raise click.ClickException(str(e)) from e
    except OSError as e:  # e.g. an input file that cannot be read
        raise click.ClickException(describe_os_error(e)) from e
    if not quiet:
        mb = result.bytes / 1e6
        click.echo(f"converted {result.tensors} tensors, {mb:.1f} MB over {result.world_size} rank(s) in "
                   f"{result.seconds:.1f} s ({mb / max(result.seconds, 1e-9):.0f} MB/s)", err=True)
    click.echo(str(result.out_dir))
