"""Registers each contract as ``torch.ops.k3.<name>`` and ``torch.ops.k3.<name>_functional``.

The reference implementation is registered for ``CompositeExplicitAutograd`` so it
runs on any device (it is plain torch); CUDA kernels override it by registering a
``CUDA`` implementation of the mutating op (``register_kernel``). The functional
twin clones the caches and calls the mutating op, so it follows whichever
implementation is active for the device.
"""
from __future__ import annotations

from typing import Callable

import torch

from .contract import OpContract

_LIB = torch.library.Library("k3", "DEF")
_REGISTERED: dict[str, OpContract] = {}

FakeFn = Callable[..., tuple[torch.Tensor, ...]]


def register(contract: OpContract, reference: Callable, fake_outputs: FakeFn) -> None:
    """Define ``k3::<name>`` and, for contracts that update caches, ``k3::<name>_functional``.

    ``reference(*inputs, *attrs)`` updates the mutated inputs in place and returns the
    contract's outputs (a tensor or a tuple). ``fake_outputs(*inputs, *attrs)`` returns a
    tuple of empty tensors of the outputs' shapes and dtypes (tracing and export).
    A stateless contract (no mutated input) is already functional: no twin is defined.
    """
    if contract.name in _REGISTERED:
        raise RuntimeError(f"k3 op {contract.name!r} registered twice")
    _REGISTERED[contract.name] = contract
    mutated_idx = [i for i, t in enumerate(contract.inputs) if t.mutated]
    single = len(contract.outputs) == 1

    _LIB.define(contract.name + contract.torch_schema(functional=False))

    def mutating_fake(*args):
        outs = fake_outputs(*args)
        return outs[0] if single else outs

    _LIB.impl(contract.name, reference, "CompositeExplicitAutograd")
    torch.library.register_fake(contract.qualified_name, mutating_fake, lib=_LIB)
    if not mutated_idx:
        return

    _LIB.define(contract.functional_name + contract.torch_schema(functional=True))
    mutating_op = getattr(torch.ops.k3, contract.name)

    def functional(*args):
        args = list(args)
        for i in mutated_idx:
            args[i] = args[i].clone()
        outs = mutating_op(*args)
        outs = (outs,) if single else tuple(outs)
        return outs + tuple(args[i] for i in mutated_idx)

    def functional_fake(*args):
        return tuple(fake_outputs(*args)) + tuple(torch.empty_like(args[i]) for i in mutated_idx)

    _LIB.impl(contract.functional_name, functional, "CompositeExplicitAutograd")
    torch.library.register_fake(f"k3::{contract.functional_name}", functional_fake, lib=_LIB)


def register_kernel(contract: OpContract, device_type: str, fn: Callable) -> None:
    """Install a device implementation (e.g. CUDA kernels) of the mutating op."""
    torch.library.impl(contract.qualified_name, device_type, lib=_LIB)(fn)


def call(contract: OpContract, *args):
    """Call an op; while ``torch.export`` traces, use the functional twin and copy the
    returned caches back, so the exported graph carries the cache updates as outputs."""
    if torch.compiler.is_exporting() and contract.mutated_inputs:
        outs = getattr(torch.ops.k3, contract.functional_name)(*args)
        n_out = len(contract.outputs)
        for spec_idx, new in zip(
            [i for i, t in enumerate(contract.inputs) if t.mutated], outs[n_out:]
        ):
            args[spec_idx].copy_(new)
        return outs[0] if n_out == 1 else outs[:n_out]
    return getattr(torch.ops.k3, contract.name)(*args)
