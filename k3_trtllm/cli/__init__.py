"""``k3-trt`` command line: one module per subcommand, registered on the group below."""
from __future__ import annotations

import importlib

import click

# Subcommands live in their own modules so that ``k3-trt --help`` stays fast and a
# missing optional dependency only breaks the command that needs it.
_SUBCOMMANDS = {
    "synth": "k3_trtllm.cli.synth:synth",
    "convert": "k3_trtllm.cli.convert:convert",
    "run": "k3_trtllm.cli.run:run",
    "bench": "k3_trtllm.cli.bench:bench",
    "build": "k3_trtllm.cli.build:build",
    "serve": "k3_trtllm.cli.serve:serve",
    "triton-repo": "k3_trtllm.cli.serve:triton_repo",
}


class _LazyGroup(click.Group):
    def list_commands(self, ctx):
        return sorted(_SUBCOMMANDS)

    def get_command(self, ctx, name):
        target = _SUBCOMMANDS.get(name)
        if target is None:
            return None
        module, attr = target.split(":")
        return getattr(importlib.import_module(module), attr)


@click.group(cls=_LazyGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="k3-trt")
def main() -> None:
    """k3-trt: Kimi-K3 checkpoints to TensorRT — synth, convert, build, run, serve."""
