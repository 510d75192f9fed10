"""OpContract.check: every contract's inputs are checked from its own shape symbols.

Valid inputs are generated from the contract (each symbol a small value; the attributes named
in attr_dims fix theirs), then each input is perturbed alone: one dim, its rank, its dtype,
its layout, its device. The check must accept exactly the calls the contract describes and
name the op and the input otherwise; the registered ops must raise the same error before any
torch code sees the tensors.
"""
from __future__ import annotations

import ast
import math

import pytest
import torch

import k3_trtllm.ops  # noqa: F401  (registers the k3:: ops)
from k3_trtllm.ops.contract import ALL_CONTRACTS, KDA_PREFILL, AttrSpec, OpContract, TensorSpec

_IDS = [c.name for c in ALL_CONTRACTS]
_DTYPE = {"act": torch.float32, "fp32": torch.float32, "int32": torch.int32, "uint8": torch.uint8}
# attribute values that pass the ops' own semantic checks (the rest are 0)
_VALID_ATTRS = {"lower_bound": -5.0, "top_k": 1, "num_expert_group": 1, "topk_group": 1, "renormalize": 1,
                "routed_scaling_factor": 1.0, "situ_beta": 1.0, "softmax_scale": 0.125}


def _names(expr: str) -> list[str]:
    return [n.id for n in ast.walk(ast.parse(expr, mode="eval")) if isinstance(n, ast.Name)]


def _evaluate(expr: str, values: dict[str, int]) -> int:
    v = eval(expr, {"__builtins__": {}}, dict(values))
    assert v == int(v), (expr, values)
    return int(v)


def _divisors(contract: OpContract) -> tuple[dict[str, int], set[str]]:
    """Each symbol's required multiple (the lcm of c over the contract's ``X/c`` dims), and the
    symbols that divide (``4*R/Q``): every other symbol is made a multiple of their values."""
    out: dict[str, int] = {}
    by_symbol: set[str] = set()
    for spec in contract.inputs + contract.outputs:
        for expr in spec.shape:
            for node in ast.walk(ast.parse(expr, mode="eval")):
                if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Div):
                    if isinstance(node.right, ast.Name):
                        by_symbol.add(node.right.id)
                        continue
                    for sym in _names(ast.unparse(node.left)):
                        out[sym] = math.lcm(out.get(sym, 1), node.right.value)
    return out, by_symbol


def _valid_call(contract: OpContract):
    """(tensors, attrs, every symbol's value) of a call the contract accepts. Values are
    distinct, so a dim checked against the wrong symbol cannot pass by accident."""
    divisors, by_symbol = _divisors(contract)
    attrs, k = {}, 2
    for sym, expr in contract.attr_dims:  # the dividing symbols first: the others are multiples
        if sym in by_symbol:
            attrs[expr] = k * divisors.get(sym, 1)
            k += 1
    common = math.lcm(*(attrs[expr] for sym, expr in contract.attr_dims if sym in by_symbol))
    for sym, expr in contract.attr_dims:
        if expr.isidentifier() and expr not in attrs:
            attrs[expr] = k * math.lcm(divisors.get(sym, 1), common)
            k += 1
    attr_values = [attrs.get(a.name, _VALID_ATTRS.get(a.name, 0)) for a in contract.attrs]
    values = {sym: _evaluate(expr, attrs) for sym, expr in contract.attr_dims}
    for spec in contract.inputs:
        for expr in spec.shape:
            for sym in _names(expr):
                if sym not in values:
                    values[sym] = k * math.lcm(divisors.get(sym, 1), common)
                    k += 1
    tensors = [torch.zeros([_evaluate(e, values) for e in spec.shape], dtype=_DTYPE[spec.dtype])
               for spec in contract.inputs]
    return tensors, attr_values, values


def _occurrences(contract: OpContract) -> dict[str, int]:
    count: dict[str, int] = {sym: 1 for sym, _ in contract.attr_dims}
    for spec in contract.inputs:
        for expr in spec.shape:
            for sym in _names(expr):
                count[sym] = count.get(sym, 0) + 1
    return count


def _binds_here(contract: OpContract, i: int, axis: int) -> str | None:
    """The symbol that input i's dim ``axis`` binds (its first occurrence), or None."""
    seen = {sym for sym, _ in contract.attr_dims}
    for j, spec in enumerate(contract.inputs):
        for a, expr in enumerate(spec.shape):
            new = [s for s in _names(expr) if s not in seen]
            if (j, a) == (i, axis):
                return new[0] if new else None
            seen.update(new)
    raise AssertionError("no such dim")


def _assert_names(err: pytest.ExceptionInfo, contract: OpContract, name: str) -> str:
    """The message names the op and the input: as the argument at fault, or as the one that
    bound a symbol a later argument then disagreed with."""
    msg = str(err.value)
    assert msg.startswith(f"{contract.qualified_name}: "), msg
    assert msg.startswith(f"{contract.qualified_name}: {name}: ") or f"bound by {name}" in msg, msg
    return msg


@pytest.mark.parametrize("contract", ALL_CONTRACTS, ids=_IDS)
def test_valid_inputs_pass_and_return_the_binding(contract):
    tensors, attrs, values = _valid_call(contract)
    assert contract.check(*tensors, *attrs) == values
    # every output dim is a function of the binding (callers allocate outputs from it)
    for out in contract.outputs:
        assert all(_evaluate(e, values) >= 0 for e in out.shape)
    # the tags' other dtypes: bf16 activations (all act inputs at once), fp64 fp32 params
    other = {"act": torch.bfloat16, "fp32": torch.float64}
    moved = [t.to(other.get(s.dtype, t.dtype)) for s, t in zip(contract.inputs, tensors)]
    assert contract.check(*moved, *attrs) == values


@pytest.mark.parametrize("contract", ALL_CONTRACTS, ids=_IDS)
def test_each_dim_is_checked_against_its_symbol(contract):
    tensors, attrs, values = _valid_call(contract)
    occurrences = _occurrences(contract)
    for i, spec in enumerate(contract.inputs):
        for axis, expr in enumerate(spec.shape):
            sym = _binds_here(contract, i, axis)
            shape = list(tensors[i].shape)
            if sym is None:  # every symbol of the dim is already bound: any other size is wrong
                shape[axis] += 1
            else:  # the dim binds sym: give sym the next value the dim can express
                shape[axis] = _evaluate(expr, {**values, sym: values[sym] + 1})
            bad = list(tensors)
            bad[i] = torch.zeros(shape, dtype=tensors[i].dtype)
            if sym is not None and occurrences[sym] == 1:  # a symbol nothing else uses is free
                assert contract.check(*bad, *attrs) == {**values, sym: values[sym] + 1}
                continue
            with pytest.raises(ValueError) as err:
                contract.check(*bad, *attrs)
            msg = _assert_names(err, contract, spec.name)
            if sym is not None:  # a later input disagrees with the binding made here
                assert f"{sym} bound by {spec.name}" in msg, msg
            else:
                assert f"shape {shape}, expected [{', '.join(spec.shape)}]" in msg, msg


@pytest.mark.parametrize("contract", ALL_CONTRACTS, ids=_IDS)
def test_each_input_rank_dtype_layout_and_device_is_checked(contract):
    tensors, attrs, values = _valid_call(contract)
    wrong_dtype = {"act": torch.int32, "fp32": torch.bfloat16, "int32": torch.int64, "uint8": torch.int8}
    first_act = next(s.name for s in contract.inputs if s.dtype == "act")
    for i, spec in enumerate(contract.inputs):
        def check_with(t):
            bad = list(tensors)
            bad[i] = t
            return contract.check(*bad, *attrs)

        with pytest.raises(ValueError) as err:
            check_with(tensors[i][..., None])
        assert f"rank {len(spec.shape) + 1}, expected {len(spec.shape)}" in _assert_names(err, contract, spec.name)

        with pytest.raises(ValueError) as err:
            check_with(tensors[i].to(wrong_dtype[spec.dtype]))
        assert f"expected {spec.dtype}" in _assert_names(err, contract, spec.name)
        if spec.dtype == "act" and spec.name != first_act:  # a float, but not the activation dtype
            with pytest.raises(ValueError) as err:
                check_with(tensors[i].double())
            assert f"expected act = float32 (the activation dtype, set by {first_act})" in str(err.value)

        strided = torch.zeros([*tensors[i].shape, 2], dtype=tensors[i].dtype)[..., 0]
        assert not strided.is_contiguous()
        if spec.mutated:  # updated in place: a copy would lose the update
            with pytest.raises(ValueError) as err:
                check_with(strided)
            assert "not contiguous" in _assert_names(err, contract, spec.name)
        else:
            assert check_with(strided) == values

        if i > 0:
            with pytest.raises(ValueError) as err:
                check_with(tensors[i].to("meta"))
            assert f"on meta, expected cpu (the device of {contract.inputs[0].name})" in \
                _assert_names(err, contract, spec.name)


def test_message_resolves_the_symbols_and_says_who_bound_them():
    tensors, attrs, values = _valid_call(KDA_PREFILL)
    T, P = values["T"], values["P"]
    names = [s.name for s in KDA_PREFILL.inputs]
    tensors[names.index("gate")] = torch.zeros(T, P + 1)
    with pytest.raises(ValueError) as err:
        KDA_PREFILL.check(*tensors, *attrs)
    assert str(err.value) == (f"k3::kda_prefill: gate: shape [{T}, {P + 1}], expected [T, P] = [{T}, {P}] "
                              "(T bound by qkv, P bound by num_heads*head_dim)")
    tensors[names.index("gate")] = torch.zeros(T, P)
    tensors[names.index("cu_seqlens")] = torch.zeros(0, dtype=torch.int32)
    with pytest.raises(ValueError, match=r"cu_seqlens: shape \[0\], expected \[B\+1\] = \[B\+1\]: dim 0 = 0 is not "
                                         r"B\+1 for a whole B >= 0"):
        KDA_PREFILL.check(*tensors, *attrs)
    with pytest.raises(TypeError, match="expected 15 tensors and 3 attributes, got 17 arguments"):
        KDA_PREFILL.check(*tensors, *attrs[:2])


@pytest.mark.parametrize("contract", ALL_CONTRACTS, ids=_IDS)
def test_ops_raise_the_contract_error_before_any_torch_code(contract):
    """Through the registered op (mutating and functional): a wrong dim, rank or dtype is
    the contract's ValueError, not an error from deep inside the reference."""
    tensors, attrs, _ = _valid_call(contract)
    occurrences = _occurrences(contract)
    ops = [getattr(torch.ops.k3, contract.name)]
    if contract.mutated_inputs:
        ops.append(getattr(torch.ops.k3, contract.functional_name))
    for i, spec in enumerate(contract.inputs):
        t = tensors[i]
        bad_inputs = [t[None], t.to(torch.int64 if spec.dtype != "int32" else torch.float32)]
        last = _binds_here(contract, i, t.dim() - 1)
        if last is None or occurrences[last] > 1:  # else the last dim is a free symbol: any size is valid
            bad_inputs.append(torch.zeros([*t.shape[:-1], t.shape[-1] + 1], dtype=t.dtype))
        for bad_t in bad_inputs:
            bad = list(tensors)
            bad[i] = bad_t
            for op in ops:
                with pytest.raises(ValueError) as err:
                    op(*bad, *attrs)
                _assert_names(err, contract, spec.name)


def test_contract_definitions_that_cannot_bind_are_rejected():
    two_new = OpContract("bad", "Bad", (TensorSpec("a", "act", ("X+Y",)),), (), ())
    with pytest.raises(ValueError, match=r"contract bad: a dim 0 \(X\+Y\) introduces \['X', 'Y'\] at once"):
        two_new.check(torch.zeros(3))
    no_attr = OpContract("bad", "Bad", (TensorSpec("a", "act", ("X",)),), (), (AttrSpec("n", "int"),),
                         attr_dims=(("X", "m"),))
    with pytest.raises(ValueError, match=r"attr_dims X = m names no attribute \['m'\]"):
        no_attr.check(torch.zeros(3), 3)
    twice = OpContract("bad", "Bad", (TensorSpec("a", "act", ("X",)),), (), (AttrSpec("n", "int"),),
                       attr_dims=(("X", "n"), ("X", "2*n")))
    with pytest.raises(ValueError, match="attr_dims binds X twice"):
        twice.check(torch.zeros(3), 3)
    call = OpContract("bad", "Bad", (TensorSpec("a", "act", ("f(X)",)),), (), ())
    with pytest.raises(ValueError, match="only names, integers and"):
        call.check(torch.zeros(3))


def test_memoized_check_returns_a_copy_and_still_refuses_what_it_reads():
    """check is memoized on what it reads (shapes, dtypes, devices, the in-place inputs'
    contiguity, the attributes): a call with the shapes of one that passed is still refused for
    a strided pool or an input on another device, and the caller's dict is its own."""
    contract = KDA_PREFILL
    tensors, attrs, values = _valid_call(contract)
    first = contract.check(*tensors, *attrs)
    first["T"] = -1
    assert contract.check(*tensors, *attrs) == values
    pool = next(i for i, spec in enumerate(contract.inputs) if spec.mutated)
    bad = list(tensors)
    bad[pool] = torch.zeros([*tensors[pool].shape, 2], dtype=tensors[pool].dtype)[..., 0]
    with pytest.raises(ValueError, match="not contiguous"):
        contract.check(*bad, *attrs)
    bad = list(tensors)
    bad[1] = tensors[1].to("meta")
    with pytest.raises(ValueError, match="on meta, expected cpu"):
        contract.check(*bad, *attrs)
    with pytest.raises(ValueError, match="expected a tensor"):
        contract.check(*tensors[:-1], [0], *attrs)
