"""The C ABI of the kernel launchers: one params struct per op family, from ``contract.py``.

A launcher takes ``const K3<Op>Params*`` and the stream. The struct holds, in this order, a
pointer per contract input (a cache pool is updated in place through its input pointer) and
per contract output, the workspace (and its size where the launcher checks it), one int per
contract dim the launcher reads, one field per contract attribute, then the fields beyond the
contract (``EXTRAS``, stated here only). The same description gives

- ``plugins/include/k3/params.h``, the C header every launcher, plugin and test includes
  (``python -m k3_trtllm.ops.c_abi > plugins/include/k3/params.h``; a test checks the
  committed file equals this output, and that the ctypes offsets equal the compiler's);
- ``NativeParams.structure``, the matching ``ctypes.Structure``, built at import, and
  ``NativeParams.fill``, which sets it from a call's tensors (the ctypes bindings);
- the plugins' input/output index enums and the code filling the struct from TensorRT's
  tensors (``k3_trtllm.export.cpp_contracts``).

Adding an input to a contract thus changes the contract and the kernel, no argument list."""
from __future__ import annotations

import ctypes
import struct
from dataclasses import dataclass
from fractions import Fraction
from functools import cached_property

from .contract import _compile as compile_dim
from .contract import (KDA_DECODE, KDA_PREFILL, MLA_DECODE, MLA_DECODE_FP8, MLA_PREFILL, MLA_PREFILL_FP8, SITU_MOE,
                       SITU_MOE_MXFP4, AttrSpec, OpContract, TensorSpec)

# C field name of each contract dim a launcher reads (the contract's symbols are terse).
DIM_FIELDS = {"T": "num_tokens", "B": "num_seqs", "W": "conv_width", "max_blocks": "max_blocks",
              "block_size": "block_size", "D": "hidden", "L": "latent", "I": "inter", "El": "num_local_experts",
              "N": "snapshot_width", "Ns": "snapshot_slots"}

_C_POINTER = {"act": "void", "fp32": "float", "int32": "int", "uint8": "uint8_t"}
_C_SCALAR = {"int": ("int", ctypes.c_int), "float": ("float", ctypes.c_float)}


@dataclass(frozen=True)
class Field:
    name: str
    c_type: str  # as declared in the header
    ctype: type  # the ctypes type of the same size and alignment
    doc: str


@dataclass(frozen=True)
class DimSource:
    """Where a dim's value is read: ``(shape[dim] - offset) * mul / div`` of input ``input``
    (the contract's expression there is ``symbol * div / mul + offset``)."""
    symbol: str
    input: int
    dim: int
    mul: int = 1
    div: int = 1
    offset: int = 0

    def value(self, extent: int) -> int:
        return (extent - self.offset) * self.mul // self.div

    def expr(self, extent: str) -> str:
        """The same in C, for the extent expression ``extent``."""
        base = extent if self.offset == 0 else f"{extent} {'-' if self.offset > 0 else '+'} {abs(self.offset)}"
        if self.offset and (self.mul != 1 or self.div != 1):
            base = f"({base})"
        return base + (f" * {self.mul}" if self.mul != 1 else "") + (f" / {self.div}" if self.div != 1 else "")


def _solve(expr: str, symbol: str) -> tuple[int, int, int] | None:
    """(mul, div, offset) reading ``symbol`` back from a dim of expression ``expr``, when
    ``expr`` names ``symbol`` alone (contract expressions are affine in it: a*X + b)."""
    fn, names = compile_dim(expr)
    if names != (symbol,):
        return None
    b = fn({symbol: 0})
    a = fn({symbol: 1}) - b
    scale = Fraction(a).limit_denominator(1 << 16)
    if scale <= 0 or b != int(b):
        return None
    return scale.denominator, scale.numerator, int(b)


def dim_source(contract: OpContract, symbol: str) -> DimSource:
    """The first input dim equal to ``symbol``, else the first it can be read back from."""
    candidates = []
    for i, t in enumerate(contract.inputs):
        for k, expr in enumerate(t.shape):
            solved = _solve(expr, symbol)
            if solved is not None:
                candidates.append((expr != symbol, i, k, solved))
    if not candidates:
        raise ValueError(f"{contract.plugin}: no input dim gives {symbol}")
    _, i, k, (mul, div, offset) = min(candidates)
    return DimSource(symbol, i, k, mul, div, offset)


@dataclass(frozen=True)
class NativeParams:
    """The params struct of the launchers of ``contracts`` (which share inputs, outputs and attrs)."""
    name: str
    contracts: tuple[OpContract, ...]
    dims: tuple[str, ...]  # contract symbols the launchers read
    workspace_bytes: bool  # the launchers check the workspace size they are given

    def __post_init__(self):
        signature = {(c.inputs, c.outputs, c.attrs) for c in self.contracts}
        if len(signature) != 1:
            raise ValueError(f"{self.name}: its contracts differ in inputs, outputs or attributes")

    @property
    def extras(self) -> tuple[AttrSpec, ...]:
        return EXTRAS.get(self.name, ())

    @property
    def contract(self) -> OpContract:
        return self.contracts[0]

    def fields(self) -> tuple[Field, ...]:
        c = self.contract
        out = [_pointer(t, mutable=t.mutated) for t in c.inputs]
        out += [_pointer(t, mutable=True) for t in c.outputs]
        out.append(Field("workspace", "void*", ctypes.c_void_p, "device scratch, 16-byte aligned"))
        if self.workspace_bytes:
            out.append(Field("workspace_bytes", "size_t", ctypes.c_size_t, "bytes at workspace"))
        for d in self.dim_sources():
            extent = f"{c.inputs[d.input].name}.shape[{d.dim}]"
            out.append(Field(DIM_FIELDS[d.symbol], "int", ctypes.c_int, f"{d.symbol} = {d.expr(extent)}"))
        out += [Field(a.name, *_C_SCALAR[a.kind], a.doc) for a in c.attrs + self.extras]
        return tuple(out)

    @property
    def structure(self) -> type[ctypes.Structure]:
        return STRUCTS[self.name]

    def dim_sources(self) -> tuple[DimSource, ...]:
        return self._dim_sources

    @cached_property
    def _dim_sources(self) -> tuple[DimSource, ...]:  # fill runs on every op call
        return tuple(dim_source(self.contract, s) for s in self.dims)

    @cached_property
    def _fill_plan(self) -> tuple:
        """What ``fill`` reads per call, in field order: counts, each dim as (input, axis, mul,
        div, offset), each attribute's converter, the extras' names (fill runs on every op call)."""
        c = self.contract
        dims = tuple((d.input, d.dim, d.mul, d.div, d.offset) for d in self.dim_sources())
        kinds = tuple(float if a.kind == "float" else int for a in c.attrs)
        return len(c.inputs), len(c.outputs), len(c.attrs), dims, kinds, tuple(a.name for a in self.extras)

    @cached_property
    def _packed(self):
        """``fill``'s work as one generated function of (inputs, outputs, attrs, workspace,
        workspace_bytes, extras), every field's expression in field order: a call is then one
        pack, with no loop over the plan (fill runs on every op call). The source is built from
        the contract's integers and names alone."""
        n_in, n_out, _, dims, kinds, extra_names = self._fill_plan
        values = [f"i[{k}].data_ptr()" for k in range(n_in)] + [f"o[{k}].data_ptr()" for k in range(n_out)]
        values.append("0 if w is None else w.data_ptr()")
        if self.workspace_bytes:
            values.append("wb")
        values += [f"(i[{i}].shape[{axis}] - {offset}) * {mul} // {div}" for i, axis, mul, div, offset in dims]
        values += [f"{kind.__name__}(a[{k}])" for k, kind in enumerate(kinds)]
        values += [f"x.get({name!r}, 0)" for name in extra_names]
        body = f"lambda i, o, a, w, wb, x: copy(pack({', '.join(values)}))"
        scope = {"__builtins__": {}, "copy": self.structure.from_buffer_copy, "pack": packer(self.structure).pack,
                 "int": int, "float": float}
        return eval(body, scope)  # noqa: S307 (generated from the contract's integers and names above)

    def fill(self, inputs, outputs, attrs, workspace=None, workspace_bytes: int = 0, **extras) -> ctypes.Structure:
        """The struct of one call: ``inputs`` / ``outputs`` tensors in contract order (pools
        are updated in place through their input), ``attrs`` in contract order, ``workspace``
        a tensor or None, ``extras`` by name (0 when not given). The values are gathered in
        field order and packed at once (``packer``: a fraction of the Structure constructor's
        cost, which runs on every op call)."""
        n_in, n_out, n_attr, _, _, extra_names = self._fill_plan
        if len(inputs) != n_in or len(outputs) != n_out or len(attrs) != n_attr:
            raise ValueError(f"{self.name}: {n_in} inputs, {n_out} outputs and {n_attr} attributes expected, "
                             f"got {len(inputs)}, {len(outputs)}, {len(attrs)}")
        if extras:
            unknown = set(extras) - set(extra_names)
            if unknown:
                raise ValueError(f"{self.name}: no field {sorted(unknown)[0]}")
        return self._packed(inputs, outputs, attrs, workspace, workspace_bytes, extras)

    def c_struct(self) -> str:
        fields = self.fields()
        width = max(len(f"{f.c_type} {f.name};") for f in fields)
        lines = [f"  {f'{f.c_type} {f.name};':<{width}}  // {f.doc}" if f.doc else f"  {f.c_type} {f.name};"
                 for f in fields]
        docs = ", ".join(c.plugin for c in self.contracts)
        body = "\n".join(lines)
        return f"// The launchers of {docs}.\ntypedef struct {self.name} {{\n{body}\n}} {self.name};\n"


def packer(structure: type[ctypes.Structure]) -> struct.Struct:
    """A ``struct.Struct`` that lays values out exactly as ``structure`` (flat fields of ctypes
    scalars, pointers and arrays of them, in declaration order), trailing padding included, so
    ``structure.from_buffer_copy(packer(structure).pack(*values))`` equals ``structure(*values)``
    at a fraction of its cost (a launcher's params are built on every call). Pointers are ints
    (0 for none). Raises ValueError where a field's offset would differ from ctypes'."""
    fmt = "@"
    for name, ctype in structure._fields_:
        code = f"{ctype._length_}{ctype._type_._type_}" if issubclass(ctype, ctypes.Array) else ctype._type_
        offset = struct.calcsize(fmt + code) - struct.calcsize("@" + code)
        if offset != getattr(structure, name).offset:
            raise ValueError(f"{structure.__name__}.{name}: struct offset {offset}, ctypes offset "
                             f"{getattr(structure, name).offset}")
        fmt += code
    pad = ctypes.sizeof(structure) - struct.calcsize(fmt)
    return struct.Struct(fmt + (f"{pad}x" if pad else ""))


def _pointer(t: TensorSpec, mutable: bool) -> Field:
    shape = f"{t.dtype} [{', '.join(t.shape)}]"
    doc = f"{shape}{', updated in place' if t.mutated else ''}{': ' + t.doc if t.doc else ''}"
    return Field(t.name, f"{'' if mutable else 'const '}{_C_POINTER[t.dtype]}*", ctypes.c_void_p, doc)


# What the launchers need beyond the contract, by struct: the one place it is stated.
_KEY_CHUNK = AttrSpec("key_chunk", "int", "keys per pass of k3_mla_prefill_expanded[_fp8] (0: the default cap); "
                    "the other launchers ignore it")
EXTRAS = {
    "K3MlaParams": (_KEY_CHUNK,),
    "K3MlaFp8Params": (_KEY_CHUNK,),
}

PARAMS: tuple[NativeParams, ...] = (
    NativeParams("K3KdaParams", (KDA_PREFILL, KDA_DECODE), ("T", "B", "W", "N", "Ns"), workspace_bytes=False),
    NativeParams("K3MlaParams", (MLA_PREFILL, MLA_DECODE), ("T", "B", "max_blocks", "block_size"),
                 workspace_bytes=True),
    NativeParams("K3MlaFp8Params", (MLA_PREFILL_FP8, MLA_DECODE_FP8), ("T", "B", "max_blocks", "block_size"),
                 workspace_bytes=True),
    NativeParams("K3SituMoeParams", (SITU_MOE,), ("T", "D", "L", "I", "El"), workspace_bytes=True),
    NativeParams("K3SituMoeMxfp4Params", (SITU_MOE_MXFP4,), ("T", "D", "L", "I", "El"), workspace_bytes=True),
)
KDA, MLA, MLA_FP8, SITU_MOE_PARAMS, SITU_MOE_MXFP4_PARAMS = PARAMS


def _structure(spec: NativeParams) -> type[ctypes.Structure]:
    return type(spec.name, (ctypes.Structure,), {"_fields_": [(f.name, f.ctype) for f in spec.fields()],
                                                 "__doc__": f"ctypes twin of {spec.name} (k3/params.h)"})


STRUCTS: dict[str, type[ctypes.Structure]] = {s.name: _structure(s) for s in PARAMS}


def generate() -> str:
    head = ("// Generated by `python -m k3_trtllm.ops.c_abi` from k3_trtllm/ops/contract.py: do not edit.\n"
            "// Change the contract (or EXTRAS in k3_trtllm/ops/c_abi.py) and regenerate; tests/test_c_abi.py\n"
            "// checks this file and the ctypes twins' offsets. The launchers' params, in the contract's order:\n"
            "// inputs, outputs, workspace, dims, attributes, then what the launchers need beyond the contract.\n"
            "#pragma once\n\n#include <stddef.h>\n#include <stdint.h>\n\n")
    return head + "\n".join(s.c_struct() for s in PARAMS)


if __name__ == "__main__":
    print(generate(), end="")
