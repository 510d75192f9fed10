"""``k3-trt triton-repo`` and ``k3-trt serve``: a Triton model repository for a model, and
the bundled tritonserver serving it."""
from __future__ import annotations

import os
import signal
import tempfile
import time
from pathlib import Path

import click

from k3_trtllm.cli.run import (check_kv_cache_dtype, check_prefix_cache, engine_dir_settings, engine_options,
                               resolve_device, threads_option)
from k3_trtllm.utils.threads import child_thread_env


def repo_options(fn):
    """Options of the generated model, shared by both commands."""
    options = [
        click.option("--name", default="k3", show_default=True, callback=_check_name,
                     help="Triton model name (letters, digits, '_', '.', '-')."),
        click.option("--seed", type=int, default=None, help="Engine seed for sampled requests without a seed."),
        click.option("--cancellation-check-period-ms", type=click.FloatRange(min=0), default=None,
                     help="How often the engine loop asks Triton whether running requests were cancelled "
                          "[default: 50]."),
    ]
    for option in reversed(options):
        fn = option(fn)
    return engine_options(fn)


def _check_name(ctx, param, value):
    from k3_trtllm.serve.repository import check_model_name

    try:
        check_model_name(value)
    except ValueError as e:
        raise click.BadParameter(str(e)) from None
    return value


def _write_repo(model_dir, repo_dir, name, force=False, **settings) -> Path:
    from k3_trtllm.serve.repository import ENGINE_PARAMETERS, write_model_repository
    from k3_trtllm.trt.segment_layout import engine_dir_kv_cache_conflict, engine_limits, is_segmented_engine_dir
    from k3_trtllm.utils.atomic import OutputError, describe_os_error

    segmented = is_segmented_engine_dir(model_dir)
    limits = {k: settings[k] for k in ("block_size", "max_seq_len")}
    if segmented:  # the engine's own unless given (they must match it)
        source = click.get_current_context().get_parameter_source
        limits = {k: v if source(k) != click.core.ParameterSource.DEFAULT else engine_limits(model_dir).get(k)
                  for k, v in limits.items()}
    # the server would only find a bad value when it loads the model
    check_prefix_cache(settings["prefix_cache"], settings["prefix_cache_interval"], settings["snapshot_slots"],
                       limits["block_size"], limits["max_seq_len"])
    if not segmented:
        check_kv_cache_dtype(settings["kv_cache_dtype"], settings["dtype"])
    else:  # the engine's own limits unless the user gave others
        engine = engine_dir_settings(model_dir, {k: v for k, v in settings.items() if k in ENGINE_PARAMETERS})
        conflict = engine_dir_kv_cache_conflict(model_dir, engine["kv_cache_dtype"])
        if conflict:
            raise click.ClickException(f"cannot serve {model_dir}: {conflict}")
        if engine["max_batch_size"] is None:  # Triton's batch bound too
            engine["max_batch_size"] = engine_limits(model_dir).get("max_batch_size")
        settings = {**{k: v for k, v in settings.items() if k not in ENGINE_PARAMETERS}, **engine}
    try:
        return write_model_repository(model_dir, repo_dir, name=name, force=force, **settings)
    except (ValueError, OutputError) as e:
        raise click.ClickException(str(e)) from e
    except OSError as e:
        raise click.ClickException(describe_os_error(e)) from e


DRAIN_TIMEOUT_S = 3.0  # the loop answers within one turn (<= 0.5 s idle, one step busy)
# After draining, tritonserver unloads the model and exits in ~3 s on this 2-core machine,
# unless a client keeps a gRPC stream open: then it never does and is killed.
STOP_AFTER_DRAIN_S = 8.0


def _interrupt(signum, frame):
    """SIGINT and SIGTERM stop the server (SIGINT is set explicitly: a shell starts a
    background job with it ignored). Later ones are ignored: the shutdown is bounded and
    must not be cut short before it has stopped every child."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    raise KeyboardInterrupt


def _drain(drain_file: Path, server) -> None:
    """Ask the model to end its in-flight requests ("server shutting down") and wait
    until it has, so that tritonserver, stopped next, has none to wait for."""
    drain_file.touch()
    done = drain_file.with_name(drain_file.name + ".done")
    deadline = time.monotonic() + DRAIN_TIMEOUT_S
    while not done.exists() and server.process.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)


@click.command("triton-repo")
@click.argument("model_dir", type=click.Path(exists=True, file_okay=False))
@click.argument("repo_dir", type=click.Path(file_okay=False))
@click.option("--force", is_flag=True, help="Replace REPO_DIR/NAME if it exists and k3-trt triton-repo wrote it.")
@repo_options
def triton_repo(model_dir, repo_dir, name, force, **settings):
    """Write a Triton model repository serving MODEL_DIR to REPO_DIR (REPO_DIR/NAME/config.pbtxt
    and REPO_DIR/NAME/1/model.py: a decoupled Python-backend model with TensorRT-LLM's client
    tensors text_input / input_ids, max_tokens, stream, ... -> text_output, output_ids)."""
    click.echo(str(_write_repo(model_dir, repo_dir, name, force, **settings)))


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
@threads_option
def serve(model_dir, host, http_port, grpc_port, metrics_port, repo_dir, startup_timeout, log_verbose, name,
          threads, **settings):
    """Serve MODEL_DIR with the tritonserver of the nvidia-pytriton wheel until Ctrl-C.

    Streaming needs gRPC (the model is decoupled); see examples/triton_client.py."""
    from k3_trtllm.runtime.tokenizer import tokenizer_fallback_reason
    from k3_trtllm.serve.server import TritonServer

    if settings.get("device") is not None:
        resolve_device(settings["device"])  # a one-line error here, not a failed model load in the server log
    fallback = tokenizer_fallback_reason(model_dir)
    if fallback:
        click.echo(f"k3-trt: warning: {fallback}", err=True)
    # The model runs in the Python backend stub, a child of tritonserver: it inherits this.
    os.environ.update(child_thread_env(threads, os.environ))
    with tempfile.TemporaryDirectory(prefix="k3-triton-") as work:
        repo = Path(repo_dir) if repo_dir else Path(work) / "repo"
        drain_file = Path(work) / "drain"
        # serve regenerates its model each start: it replaces one k3-trt wrote, nothing else
        _write_repo(model_dir, repo, name, True, drain_file=str(drain_file), **settings)
        server = TritonServer(repo, work, host=host, http_port=http_port, grpc_port=grpc_port,
                              metrics_port=metrics_port, verbose=log_verbose)
        signal.signal(signal.SIGINT, _interrupt)
        signal.signal(signal.SIGTERM, _interrupt)
        ready = False
        try:
            server.start()
            server.wait_ready(startup_timeout)
            ready = True
            click.echo(f"k3-trt: model '{name}' ready — gRPC {server.grpc_url} (streaming), HTTP {server.http_url}, "
                       f"metrics {server.metrics_url}; Ctrl-C stops", err=True)
            code = server.wait()
            raise click.ClickException(f"tritonserver exited with code {code}")
        except RuntimeError as e:
            raise click.ClickException(str(e)) from e
        except KeyboardInterrupt:
            click.echo("k3-trt: stopping: ending in-flight requests, then tritonserver", err=True)
            if ready:
                _drain(drain_file, server)
        finally:
            code = server.stop(STOP_AFTER_DRAIN_S)
        if server.forced:
            click.echo(f"k3-trt: tritonserver did not exit within {STOP_AFTER_DRAIN_S:.0f} s of SIGINT (a client "
                       "keeping a gRPC stream open holds the model); killed it", err=True)
        elif code:
            raise click.ClickException(f"tritonserver exited with code {code} while stopping")
