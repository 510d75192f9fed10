"""Writes the Triton model repository of a k3-trt model: ``REPO/NAME/config.pbtxt`` and
``REPO/NAME/1/model.py``, and reads the engine settings back inside the model."""
from __future__ import annotations

from pathlib import Path

from k3_trtllm.serve.protocol import INPUTS, OUTPUTS

# Engine settings carried as config.pbtxt parameters: name -> how to read the string back.
# They are build_engine's keyword arguments, plus the loop's cancellation check period.
ENGINE_PARAMETERS = {
    "dtype": str, "device": str, "block_size": int, "max_batch_size": int, "max_num_tokens": int,
    "max_seq_len": int, "num_blocks": int, "max_slots": int, "cache_memory_gb": float, "seed": int,
}
LOOP_PARAMETERS = {"cancellation_check_period_ms": float}

MODEL_PY = '''"""Triton Python-backend entry point written by `k3-trt triton-repo`; the model is
k3_trtllm.serve.triton_model (k3-trt must be installed in the Python that runs the stub)."""
from k3_trtllm.serve.triton_model import TritonPythonModel  # noqa: F401
'''


def write_model_repository(model_dir: str | Path, repo_dir: str | Path, *, name: str = "k3",
                           max_batch_size: int = 64, **settings) -> Path:
    """Write the repository; ``settings`` are ENGINE_PARAMETERS / LOOP_PARAMETERS
    (None leaves a setting to the engine's default). Returns the model's folder."""
    model_dir = Path(model_dir).resolve()
    if not (model_dir / "config.json").is_file():
        raise ValueError(f"model_dir {model_dir} has no config.json")
    if not name or "/" in name or name.startswith("."):
        raise ValueError(f"model name {name!r} must be a plain folder name")
    unknown = set(settings) - set(ENGINE_PARAMETERS) - set(LOOP_PARAMETERS)
    if unknown:
        raise ValueError(f"unknown engine settings {sorted(unknown)}")
    parameters = {"model_dir": str(model_dir), "max_batch_size": max_batch_size,
                  **{k: v for k, v in settings.items() if v is not None}}
    model = Path(repo_dir) / name
    (model / "1").mkdir(parents=True, exist_ok=True)
    (model / "config.pbtxt").write_text(config_pbtxt(name, max_batch_size, parameters))
    (model / "1" / "model.py").write_text(MODEL_PY)
    return model


def config_pbtxt(name: str, max_batch_size: int, parameters: dict) -> str:
    lines = [f'name: "{name}"', 'backend: "python"', f"max_batch_size: {max_batch_size}",
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
        lines.append(f'parameters {{ key: "{key}" value: {{ string_value: "{_escape(str(value))}" }} }}')
    return "\n".join(lines) + "\n"


def _escape(text: str) -> str:
    return text.replace("\\", "\\\\").replace('"', '\\"')


def engine_kwargs_from_parameters(parameters: dict[str, str]) -> tuple[str, dict, dict]:
    """config.pbtxt parameters -> (model_dir, build_engine kwargs, EngineLoop kwargs)."""
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
        else:
            engine[key] = value
    dtype = getattr(torch, engine.get("dtype", "bfloat16"), None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"config.pbtxt parameter dtype={engine['dtype']!r} is not a torch dtype")
    engine["dtype"] = dtype
    engine.setdefault("device", "cuda" if torch.cuda.is_available() else "cpu")
    if "cache_memory_gb" not in engine and ("num_blocks" not in engine or "max_slots" not in engine):
        engine["cache_memory_gb"] = 2.0  # the same default as `k3-trt run`
    return parameters["model_dir"], engine, loop
