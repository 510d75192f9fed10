"""Run an exported step graph on CPU with ``onnx.reference.ReferenceEvaluator``.

The ``k3`` nodes run the torch reference ops (the same ``k3::`` ops the model calls),
through ``OpRun`` classes generated from the contracts; every other node runs onnx's own
reference implementation. Used to prove the graph computes what the torch model does."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from onnx.reference import ReferenceEvaluator
from onnx.reference.op_run import OpRun

from ..ops.contract import ALL_CONTRACTS, OpContract
from .engine_io import STEP_INPUTS, TensorIO
from .schemas import BYTES_CONTRACT_DTYPE, DOMAIN, register_schemas
from .translations import exported_op


def _make_oprun(contract: OpContract) -> type[OpRun]:
    op = exported_op(contract)
    # the graph carries contract-"uint8" bytes as INT8 (schemas.BYTES_ONNX_TYPE); the ops read uint8
    read_as = [np.uint8 if t.dtype == BYTES_CONTRACT_DTYPE else None for t in contract.inputs]

    def _run(self, *inputs, **attributes):
        # copies: the evaluator's arrays may be read-only views of the weights
        arrays = [np.array(x, copy=True) for x in inputs]
        tensors = [torch.from_numpy(a if dt is None else a.view(dt)) for a, dt in zip(arrays, read_as)]
        values = [attributes[a.name] for a in contract.attrs]
        outs = op(*tensors, *values)
        outs = (outs,) if isinstance(outs, torch.Tensor) else outs
        return tuple(o.numpy() for o in outs)

    return type(contract.plugin, (OpRun,), {"op_domain": DOMAIN, "_run": _run})


K3_OPRUNS: tuple[type[OpRun], ...] = tuple(_make_oprun(c) for c in ALL_CONTRACTS)


class CpuStepGraph:
    """Executes ``rank{r}.onnx``: ``run(step, pools)`` -> (logits, updated pools)."""

    def __init__(self, path: str | Path, inputs: tuple[TensorIO, ...]):
        register_schemas()
        self.session = ReferenceEvaluator(str(path), new_ops=list(K3_OPRUNS))
        self.inputs = inputs

    def run(self, step_tensors: list[torch.Tensor], pools: list[torch.Tensor]) -> list[torch.Tensor]:
        if len(step_tensors) != len(STEP_INPUTS) or len(step_tensors) + len(pools) != len(self.inputs):
            raise ValueError(f"expected {len(STEP_INPUTS)} step tensors and "
                             f"{len(self.inputs) - len(STEP_INPUTS)} pools")
        feeds = {t.name: x.numpy() for t, x in zip(self.inputs, list(step_tensors) + list(pools))}
        return [torch.from_numpy(np.asarray(o)) for o in self.session.run(None, feeds)]
