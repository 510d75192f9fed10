"""``k3-trt synth``: write a random K3 checkpoint in the exact HF layout."""
from __future__ import annotations

import click

from ..checkpoint.synth import PRESETS, synth_checkpoint
from ..utils.atomic import OutputError, describe_os_error


@click.command()
@click.argument("out_dir", type=click.Path(file_okay=False))
@click.option("--preset", type=click.Choice(PRESETS), default="tiny", show_default=True,
              help="tiny: spec §8 config (bf16 experts); tiny-mxfp4: MXFP4 experts; tiny-nested: kimi_k3 "
                   "nested form with vision tensors; kernel-shapes: K3 head shapes at tiny width.")
@click.option("--seed", type=int, default=0, show_default=True)
@click.option("--force", is_flag=True, help="Replace OUT_DIR if it exists and k3-trt synth wrote it.")
def synth(out_dir: str, preset: str, seed: int, force: bool) -> None:
    """Write a random K3 checkpoint (config.json, safetensors shards, index) to OUT_DIR."""
    try:
        path = synth_checkpoint(out_dir, preset, seed, force)
    except OutputError as e:
        raise click.ClickException(str(e)) from e
    except OSError as e:
        raise click.ClickException(describe_os_error(e)) from e
    click.echo(str(path))
