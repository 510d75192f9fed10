"""Writes the Triton model repository of a k3-trt model: ``REPO/NAME/config.pbtxt`` and
``REPO/NAME/1/model.py``, and reads the engine settings back inside the model."""
from __future__ import annotations

import contextlib
import os
import re
from pathlib import Path

from k3_trtllm.serve.protocol import INPUTS, OUTPUTS
from k3_trtllm.utils.atomic import OutputError, atomic_output_dir, check_output, input_paths, write_file

# Engine settings carried as config.pbtxt parameters: name -> how to read the string back.
# They are build_engine's keyword arguments, plus the loop's cancellation check period.
def flag(text: str) -> bool:
    """A boolean parameter as config.pbtxt carries it (``str(True)``/``str(False)``)."""
    if text not in ("True", "False"):
        raise ValueError(text)
    return text == "True"


ENGINE_PARAMETERS = {
    "batch_invariant": flag,
    "dtype": str, "device": str, "block_size": int, "max_batch_size": int, "max_num_tokens": int,
    "max_seq_len": int, "num_blocks": int, "max_slots": int, "cache_memory_gb": float, "seed": int,
    "tp": int, "ep": int,  # world size > 1: the Triton model is rank 0 and starts the other ranks
    "prefix_cache": flag, "prefix_cache_interval": int, "snapshot_slots": int,
    "kv_cache_dtype": str,  # auto | bf16 | fp8 (model/caches.py); an engine dir's own unless given
}
# The loop's cancellation check period, and the file whose appearance drains the loop.
LOOP_PARAMETERS = {"cancellation_check_period_ms": float, "drain_file": str}
# Triton takes a model's name from its folder in the repository and must find the same
# name in config.pbtxt; clients put it in URL paths (/v2/models/NAME/...) and metric
# labels. Triton states no character set, so k3-trt accepts what is safe in all of them.
MODEL_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]{0,99}")

OUTPUT_KIND = "triton-model"
MODEL_PY = '''"""Triton Python-backend entry point written by `k3-trt triton-repo`; the model is
k3_trtllm.serve.triton_model (k3-trt must be installed in the Python that runs the stub)."""
from k3_trtllm.serve.triton_model import TritonPythonModel  # noqa: F401
'''


def write_model_repository(model_dir: str | Path, repo_dir: str | Path, *, name: str = "k3",
                           max_batch_size: int = 64, force: bool = False, **settings) -> Path:
    """Write the repository; ``settings`` are ENGINE_PARAMETERS / LOOP_PARAMETERS
    (None leaves a setting to the engine's default); ``force`` replaces a model folder
    k3-trt wrote before. Returns the model's folder."""
    model_dir = Path(model_dir).resolve()
    if not (model_dir / "config.json").is_file():
        raise ValueError(f"model_dir {model_dir} has no config.json")
    check_model_name(name)
    unknown = set(settings) - set(ENGINE_PARAMETERS) - set(LOOP_PARAMETERS)
    if unknown:
        raise ValueError(f"unknown engine settings {sorted(unknown)}")
    parameters = {"model_dir": str(model_dir), "max_batch_size": max_batch_size,
                  **{k: v for k, v in settings.items() if v is not None}}
    return _write_model(model_dir, Path(repo_dir), name, config_pbtxt(name, max_batch_size, parameters), force)


def _write_model(model_dir: Path, repo: Path, name: str, pbtxt: str, force: bool) -> Path:
    """REPO/NAME whole or not at all, by the rules of every k3-trt output (utils.atomic):
    replaced only with ``force`` and when k3-trt wrote it, never in or around the model.
    REPO itself is created when missing (and removed again if the write fails); other
    models in it are left alone."""
    inputs = input_paths(model_dir)
    model = repo / name
    made_repo = not os.path.lexists(repo)
    if made_repo:
        check_output(repo, OUTPUT_KIND, inputs=inputs)  # not in the model, and its parent exists
        try:
            repo.mkdir()
        except OSError as e:
            raise OutputError(f"{repo}: cannot create the repository: {e.strerror}") from e
    try:
        with atomic_output_dir(model, OUTPUT_KIND, force=force, inputs=inputs) as tmp:
            (tmp / "1").mkdir()
            write_file(tmp / "config.pbtxt", pbtxt)
            write_file(tmp / "1" / "model.py", MODEL_PY)
    except BaseException:
        if made_repo:
            with contextlib.suppress(OSError):
                repo.rmdir()
        raise
    return model


def check_model_name(name: str) -> None:
    """ValueError unless ``name`` is a model name k3-trt writes (see MODEL_NAME)."""
    if not isinstance(name, str) or not MODEL_NAME.fullmatch(name):
        raise ValueError(f"model name {name!r}: use 1-100 letters, digits, '_', '.' or '-', not starting "
                         "with '.' or '-'")


def config_pbtxt(name: str, max_batch_size: int, parameters: dict) -> str:
    lines = [f'name: "{_escape(name)}"', 'backend: "python"', f"max_batch_size: {max_batch_size}",
             # Streaming needs a decoupled model: any number of responses per request.
             "model_transaction_policy { decoupled: true }", ""]
    for name_, (dtype, dims, optional) in INPUTS.items():
        lines.append(f'input {{ name: "{name_}" data_type: {dtype} dims: {dims}'
                     f'{" optional: true" if optional else ""} }}')
    for name_, (dtype, dims) in OUTPUTS.items():
        lines.append(f'output {{ name: "{name_}" data_type: {dtype} dims: {dims} }}')
    # One instance: the engine batches inflight itself, across all requests.
    lines += ["", "instance_group [{ count: 1 kind: KIND_CPU }]", ""]
    for key, value in parameters.items():
        lines.append(f'parameters {{ key: "{_escape(key)}" value: {{ string_value: "{_escape(str(value))}" }} }}')
    return "\n".join(lines) + "\n"


def _escape(text: str) -> str:
    """``text`` as the inside of a protobuf text-format string: quotes and backslashes
    escaped, control characters as octal escapes of their bytes (a newline or quote in
    a model path cannot end the string or the line)."""
    out = []
    for ch in text:
        if ch in '"\\':
            out.append("\\" + ch)
        elif ord(ch) < 0x20 or ord(ch) == 0x7F:
            out.append(f"\\{ord(ch):03o}")
        else:
            out.append(ch)
    return "".join(out)


def engine_kwargs_from_parameters(parameters: dict[str, str], engine_dir: bool = False) -> tuple[str, dict, dict]:
    """config.pbtxt parameters -> (model_dir, build_engine kwargs, EngineLoop kwargs); for a
    segmented ``engine_dir``, ``engine_dir_engine`` kwargs: only what the parameters give (the
    engine's config supplies the rest), dtype as its name."""
    import torch

    if "model_dir" not in parameters:
        raise ValueError("config.pbtxt has no 'model_dir' parameter")
    engine, loop = {}, {}
    for key, text in parameters.items():
        if key == "model_dir":
            continue
        cast = ENGINE_PARAMETERS.get(key) or LOOP_PARAMETERS.get(key)
        if cast is None:
            raise ValueError(f"unknown config.pbtxt parameter {key!r}")
        try:
            value = cast(text)
        except ValueError:
            raise ValueError(f"config.pbtxt parameter {key}={text!r} is not a {cast.__name__}") from None
        if key == "cancellation_check_period_ms":
            loop["cancel_check_period_s"] = value / 1e3
        elif key == "drain_file":
            from k3_trtllm.serve.engine_loop import file_drain  # the loop needs torch; writing a repo does not

            loop.update(file_drain(value))
        else:
            engine[key] = value
    engine.setdefault("device", "cuda" if torch.cuda.is_available() else "cpu")
    if engine_dir:
        return parameters["model_dir"], engine, loop
    dtype = getattr(torch, engine.get("dtype", "bfloat16"), None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"config.pbtxt parameter dtype={engine['dtype']!r} is not a torch dtype")
    engine["dtype"] = dtype
    if "cache_memory_gb" not in engine and ("num_blocks" not in engine or "max_slots" not in engine):
        from k3_trtllm.runtime.block_manager import DEFAULT_CACHE_MEMORY_GB

        engine["cache_memory_gb"] = DEFAULT_CACHE_MEMORY_GB
    return parameters["model_dir"], engine, loop
