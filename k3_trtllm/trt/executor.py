"""``TensorRTExecutor``: runs a ``k3-trt build`` plan for the runner (``Executor`` protocol).

It owns the cache pools (torch CUDA tensors) and binds each pool to its input *and* its
``_out`` output at the same address, so the plugins update the pools in place; step
tensors and logits are bound by name; the profile is picked from host-side extents.
TensorRT-RTX plans do not run on the H200 (sm90) and nothing runs without a GPU, so this
executor has not been run here: CI checks its binding plan against the ONNX graph."""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

from ..model.step import StepInputs
from .builder import PROFILE_ORDER
from .profiles import BuildLimits, pick_profile

_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32, "int32": torch.int32}


@dataclass(frozen=True)
class Binding:
    name: str  # engine tensor name
    source: str  # "step:<field>" | "pool:<input name>" | "logits"
    is_input: bool


def binding_plan(config: dict) -> list[Binding]:
    """Every engine I/O tensor and what is bound to it, from the build config."""
    plan = []
    for t in config["inputs"]:
        plan.append(Binding(t["name"], f"pool:{t['name']}" if "pool" in t else f"step:{t['name']}", True))
    aliases = {out: pool for pool, out in config["aliases"].items()}
    for t in config["outputs"]:
        source = f"pool:{aliases[t['name']]}" if t["name"] in aliases else t["name"]
        plan.append(Binding(t["name"], source, False))
    return plan


class TensorRTExecutor:
    def __init__(self, engine_dir: str | Path, *, num_blocks: int, max_slots: int, plugin_lib: str | Path,
                 device: str = "cuda", builder: str = "auto") -> None:
        from .bindings import import_tensorrt
        from .builder import load_plugin_library

        engine_dir = Path(engine_dir)
        self.config = json.loads((engine_dir / "config.json").read_text())
        plan_file = self.config["ranks"][0]["plan"]
        if plan_file is None:
            raise FileNotFoundError(f"{engine_dir}: no plan was built (see config.json 'builder')")
        lim = self.config["limits"]
        self.limits = BuildLimits(lim["max_batch_size"], lim["max_num_tokens"], lim["max_seq_len"], lim["block_size"])
        if not 1 <= num_blocks <= lim["max_num_blocks"] or not 1 <= max_slots <= lim["max_batch_size"]:
            raise ValueError(f"num_blocks must be in [1, {lim['max_num_blocks']}] and max_slots in "
                             f"[1, {lim['max_batch_size']}] (the plan's profiles)")
        trt = import_tensorrt(builder)
        load_plugin_library(trt, plugin_lib)
        self._logger = trt.Logger(trt.Logger.WARNING)
        self._runtime = trt.Runtime(self._logger)
        self.engine = self._runtime.deserialize_cuda_engine((engine_dir / plan_file).read_bytes())
        if self.engine is None:
            raise RuntimeError(f"{engine_dir / plan_file}: TensorRT could not deserialise the plan")
        self.context = self.engine.create_execution_context()
        self.device = torch.device(device)
        self.vocab_size = int(self.config["outputs"][0]["shape"][1])
        self.plan = binding_plan(self.config)
        self.pools: dict[str, torch.Tensor] = {}
        for t in self.config["inputs"]:
            if "pool" in t:
                shape = [num_blocks if d == "num_blocks" else max_slots if d == "max_slots" else d for d in t["shape"]]
                self.pools[t["name"]] = torch.zeros(shape, dtype=_DTYPES[t["dtype"]], device=self.device)
        self._stream = torch.cuda.Stream(self.device)
        self._profile = None

    def execute(self, step: StepInputs) -> torch.Tensor:
        step = step.to(self.device)
        phase = pick_profile(step.num_tokens, step.num_seqs, self.limits)
        stream = self._stream.cuda_stream
        if phase != self._profile:
            self.context.set_optimization_profile_async(PROFILE_ORDER.index(phase), stream)
            self._profile = phase
        logits = torch.empty(step.logits_indices.shape[0], self.vocab_size, dtype=torch.float32, device=self.device)
        for b in self.plan:
            kind, _, key = b.source.partition(":")
            tensor = logits if kind == "logits" else self.pools[key] if kind == "pool" else getattr(step, key).contiguous()
            if b.is_input:
                self.context.set_input_shape(b.name, tuple(tensor.shape))
            self.context.set_tensor_address(b.name, tensor.data_ptr())
        self._stream.wait_stream(torch.cuda.current_stream(self.device))
        if not self.context.execute_async_v3(stream):
            raise RuntimeError("TensorRT execute_async_v3 failed")
        torch.cuda.current_stream(self.device).wait_stream(self._stream)
        return logits
