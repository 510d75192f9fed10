"""The K3 reference model over the ``k3::`` ops, and checkpoint loading."""
from __future__ import annotations

import warnings
from pathlib import Path

import torch
import torch.distributed as dist

from .. import ops  # noqa: F401  (registers the k3:: ops)
from ..checkpoint.detect import HF, checkpoint_format
from ..checkpoint.errors import CheckpointError
from ..checkpoint.loader import load_hf_state_dict
from ..checkpoint.trtllm import load_trtllm_state_dict, read_trtllm_config
from ..ops.cuda_library import library_path as kernel_library_path
from ..ops.cuda_library import register_cuda_kernels
from ..ops.common import compute_dtype
from .caches import K3Caches
from .k3 import K3ForCausalLM
from .layers import prepare_weights_
from .parallel import Parallel
from .step import StepInputs, build_step

__all__ = ["K3ForCausalLM", "K3Caches", "Parallel", "StepInputs", "build_step", "load_model",
           "model_from_state_dict", "prepare_weights_"]


def model_from_state_dict(cfg, state: dict[str, torch.Tensor], dtype: torch.dtype = torch.bfloat16,
                          device: torch.device | str = "cpu", parallel: Parallel = Parallel()) -> K3ForCausalLM:
    """Build the model (one rank of it under ``parallel``) and load ``state`` strictly (every
    buffer assigned exactly once), then lay the weights out for the kernels (``prepare_weights_``).
    Non-bf16 ``dtype`` (fp32, fp64) upcasts the bf16 weights and the fp32 ones follow the
    compute dtype, so exactness tests can run the whole model in high precision."""
    with torch.device("meta"):
        model = K3ForCausalLM(cfg, parallel)
    model = model.to_empty(device=device)
    expected, given = set(model.state_dict()), set(state)
    if expected != given:
        missing, extra = sorted(expected - given), sorted(given - expected)
        raise CheckpointError(f"model tensors do not match: missing {missing[:10]}, unexpected {extra[:10]}")
    own = model.state_dict()
    for name, tensor in state.items():
        if tuple(own[name].shape) != tuple(tensor.shape):
            raise CheckpointError(f"tensor {name!r}: shape {list(tensor.shape)}, expected {list(own[name].shape)}")
        if own[name].dtype != tensor.dtype:  # assign=True would keep a wrong dtype, and run in it
            raise CheckpointError(f"tensor {name!r}: dtype {str(tensor.dtype).removeprefix('torch.')}, expected "
                                  f"{str(own[name].dtype).removeprefix('torch.')}")
    # assign=True keeps the given tensors, so they must already live on the model's device
    model.load_state_dict({name: tensor.to(device) for name, tensor in state.items()}, strict=True, assign=True)
    if dtype != torch.bfloat16:
        for module in model.modules():
            for name, buf in module.named_buffers(recurse=False):
                if buf.dtype == torch.bfloat16:
                    setattr(module, name, buf.to(dtype))
                elif buf.dtype == torch.float32:
                    setattr(module, name, buf.to(compute_dtype(dtype)))
    return prepare_weights_(model).eval()


def load_model(path: str | Path, dtype: torch.dtype = torch.bfloat16,
               device: torch.device | str = "cpu") -> K3ForCausalLM:
    """Load an HF K3 checkpoint or a converted (TensorRT-LLM format) one. A converted
    checkpoint of world size N > 1 needs a torch.distributed process group of N processes:
    each loads the rank file of its own rank. On a CUDA device the CUDA kernels become the
    ops' implementations when their library is built; otherwise the (slow) reference ops
    run on the GPU, with a warning. Any other directory raises ``CheckpointError`` saying
    what it holds."""
    fmt = checkpoint_format(path)  # before the kernels: a wrong directory fails first, alone
    if torch.device(device).type == "cuda" and not register_cuda_kernels():
        warnings.warn(f"{kernel_library_path()} not built (build_scripts/build_kernels.sh): the k3 ops run "
                      "as fp32 torch reference code on the GPU", stacklevel=2)
    if fmt == HF:
        cfg, state = load_hf_state_dict(path)
        return model_from_state_dict(cfg, state, dtype, device)
    cfg, data = read_trtllm_config(path)
    rank = _process_rank(path, data["mapping"].get("world_size"))
    parallel = Parallel.from_mapping(data["mapping"], cfg, rank, f"{path}/config.json")
    cfg, state, _ = load_trtllm_state_dict(path, rank)
    return model_from_state_dict(cfg, state, dtype, device, parallel)


def _process_rank(path, world_size) -> int:
    """0 for a world-size-1 checkpoint, else this process's rank in a process group of that size."""
    if world_size == 1:
        return 0
    group = dist.get_world_size() if dist.is_available() and dist.is_initialized() else None
    if group != world_size:
        running = f"a process group of {group}" if group else "no torch.distributed process group"
        raise CheckpointError(
            f"{path}: world size {world_size}, and this process runs {running}; run one process per rank with "
            f"torch.distributed initialised for {world_size} ranks (or convert with --tp 1 --ep 1, or run the "
            "HF checkpoint)")
    return dist.get_rank()
