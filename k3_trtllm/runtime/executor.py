"""What runs a step: the engine only needs ``execute(step) -> logits``."""
from __future__ import annotations

from typing import Protocol

import torch

from k3_trtllm.model.step import StepInputs


class Executor(Protocol):
    """Runs one step of the model against cache pools it owns.

    ``execute`` returns fp32 logits ``[len(step.logits_indices), vocab_size]`` and
    updates the latent-cache blocks and KDA state rows named by the step in place.
    """

    vocab_size: int
    device: torch.device

    def execute(self, step: StepInputs) -> torch.Tensor: ...


class TorchExecutor:
    """The torch model (reference ops on CPU, CUDA kernels where registered)."""

    def __init__(self, model: torch.nn.Module, caches, device: torch.device | str) -> None:
        self.model = model
        self.caches = caches
        self.device = torch.device(device)
        self.vocab_size = int(model.config.vocab_size)

    @torch.inference_mode()
    def execute(self, step: StepInputs) -> torch.Tensor:
        return self.model(step.to(self.device), self.caches)
