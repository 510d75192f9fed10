"""The module that is exported: one engine step with flat, named tensor I/O.

Inputs are the step tensors then the cache pools (``engine_io``); outputs are the logits
then every pool after the step. The pools are returned explicitly: the ops' functional
twins write the updated pools back into the inputs while exporting (``registry.call``),
and returning them is what turns those writes into graph outputs (DESIGN §9: otherwise
the exporter drops them without a word). ``decode`` is the phase traced: the graph
holds that phase's op forms, whatever steps later run through it."""
from __future__ import annotations

import torch
from torch import nn

from ..model.caches import K3Caches
from .engine_io import STEP_INPUTS, TensorIO, step_from_flat


class StepGraph(nn.Module):
    def __init__(self, model: nn.Module, pools: tuple[TensorIO, ...], block_size: int, *, decode: bool):
        super().__init__()
        self.model, self.pools, self.block_size, self.decode = model, pools, block_size, decode

    def forward(self, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
        n = len(STEP_INPUTS)
        step = step_from_flat(tensors[:n])
        pool_tensors = tensors[n:]
        caches = K3Caches({}, {}, {}, self.block_size)
        for spec, t in zip(self.pools, pool_tensors):
            getattr(caches, spec.pool)[spec.layer] = t
        logits = self.model(step, caches, decode=self.decode)
        return (logits, *pool_tensors)
