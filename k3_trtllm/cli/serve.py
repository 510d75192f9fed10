"""``k3-trt triton-repo`` and ``k3-trt serve``: a Triton model repository for a model, and
the bundled tritonserver serving it."""
from __future__ import annotations

import signal
import tempfile
from pathlib import Path

import click

from k3_trtllm.cli.run import engine_options


def repo_options(fn):
    """Options of the generated model, shared by both commands."""
    options = [
        click.option("--name", default="k3", show_default=True, help="Triton model name."),
        click.option("--seed", type=int, default=None, help="Engine seed for sampled requests without a seed."),
        click.option("--cancellation-check-period-ms", type=click.FloatRange(min=0), default=None,
                     help="How often the engine loop asks Triton whether running requests were cancelled "
                          "[default: 50]."),
    ]
    for option in reversed(options):
        fn = option(fn)
    return engine_options(fn)


def _write_repo(model_dir, repo_dir, name, **settings) -> Path:
    from k3_trtllm.serve.repository import write_model_repository

    try:
        return write_model_repository(model_dir, repo_dir, name=name, **settings)
    except (ValueError, OSError) as e:
        raise click.ClickException(str(e)) from e


def _interrupt(signum, frame):
    """SIGINT and SIGTERM stop the server (SIGINT is set explicitly: a shell starts a
    background job with it ignored)."""
    raise KeyboardInterrupt


@click.command("triton-repo")
@click.argument("model_dir", type=click.Path(exists=True, file_okay=False))
@click.argument("repo_dir", type=click.Path(file_okay=False))
@repo_options
def triton_repo(model_dir, repo_dir, name, **settings):
    """Write a Triton model repository serving MODEL_DIR to REPO_DIR (REPO_DIR/NAME/config.pbtxt
    and REPO_DIR/NAME/1/model.py: a decoupled Python-backend model with TensorRT-LLM's client
    tensors text_input / input_ids, max_tokens, stream, ... -> text_output, output_ids)."""
    click.echo(str(_write_repo(model_dir, repo_dir, name, **settings)))


@click.command()
@click.argument("model_dir", type=click.Path(exists=True, file_okay=False))
@click.option("--host", default="127.0.0.1", show_default=True, help="Address the endpoints listen on.")
@click.option("--http-port", type=click.IntRange(1, 65535), default=8000, show_default=True)
@click.option("--grpc-port", type=click.IntRange(1, 65535), default=8001, show_default=True)
@click.option("--metrics-port", type=click.IntRange(1, 65535), default=8002, show_default=True)
@click.option("--repo-dir", type=click.Path(file_okay=False), default=None,
              help="Where to write the model repository [default: a temporary folder].")
@click.option("--startup-timeout", type=click.FloatRange(min=1), default=600, show_default=True,
              help="Seconds to wait for the server and the model to be ready.")
@click.option("--log-verbose", type=click.IntRange(min=0), default=0, show_default=True,
              help="tritonserver --log-verbose level.")
@repo_options
def serve(model_dir, host, http_port, grpc_port, metrics_port, repo_dir, startup_timeout, log_verbose, name,
          **settings):
    """Serve MODEL_DIR with the tritonserver of the nvidia-pytriton wheel until Ctrl-C.

    Streaming needs gRPC (the model is decoupled); see examples/triton_client.py."""
    from k3_trtllm.serve.server import TritonServer

    with tempfile.TemporaryDirectory(prefix="k3-triton-") as work:
        repo = Path(repo_dir) if repo_dir else Path(work) / "repo"
        _write_repo(model_dir, repo, name, **settings)
        server = TritonServer(repo, work, host=host, http_port=http_port, grpc_port=grpc_port,
                              metrics_port=metrics_port, verbose=log_verbose)
        signal.signal(signal.SIGINT, _interrupt)
        signal.signal(signal.SIGTERM, _interrupt)
        try:
            server.start()
            server.wait_ready(startup_timeout)
            click.echo(f"k3-trt: model '{name}' ready — gRPC {server.grpc_url} (streaming), HTTP {server.http_url}, "
                       f"metrics {server.metrics_url}; Ctrl-C stops", err=True)
            code = server.wait()
            raise click.ClickException(f"tritonserver exited with code {code}")
        except RuntimeError as e:
            raise click.ClickException(str(e)) from e
        except KeyboardInterrupt:
            click.echo("k3-trt: stopping tritonserver", err=True)
        finally:
            server.stop()
