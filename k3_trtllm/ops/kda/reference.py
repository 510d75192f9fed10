"""Reference implementations of the KDA_PREFILL and KDA_DECODE contracts.

Both ops take the same arguments and compute the same function: short conv + SiLU,
l2-normalised q/k, decay gate, beta, gated delta rule, per sequence of a varlen batch,
reading and writing the sequence's conv / recurrent state row in place. Prefill runs
the chunked form, decode the token recurrence; they agree up to summation order. Prefill
also writes the prefix cache's snapshots: the states at the step's snapshot points, into
rows of the snapshot pools; decode takes none.
Math in fp32 (fp64 when the activations are fp64); conv output and core output rounded
to the activation dtype where the model rounds them (§4.5.2, §7.10).
"""
from __future__ import annotations

import torch

from .. import registry
from ..common import compute_dtype
from ..contract import KDA_CHUNK, KDA_DECODE, KDA_PREFILL
from .naive import chunk_kda, conv_state_at, kda_gate, l2_normalize, recurrent_kda, short_conv


def check_attributes(num_heads: int, head_dim: int, lower_bound: float) -> None:
    """The attribute bounds the contract's dims do not state (shared with the CUDA binding)."""
    if num_heads <= 0 or head_dim <= 0:
        raise ValueError(f"kda: num_heads and head_dim must be positive, got {num_heads}, {head_dim}")
    if not (lower_bound == 0.0 or -5.0 <= lower_bound < 0.0):
        raise ValueError(f"kda: lower_bound must be in [-5, 0), or 0.0 for the softplus gate, got {lower_bound}")


def _batch_layout(cu_seqlens, state_slots, has_initial_state, num_tokens: int, num_slots: int):
    """(token offsets, state row, continues-from-state flag) of the sequences, validated."""
    offsets = cu_seqlens.tolist()
    if offsets[0] != 0 or offsets[-1] != num_tokens:
        raise ValueError(f"kda: cu_seqlens must run from 0 to T={num_tokens}, got {offsets[0]}..{offsets[-1]}")
    if any(b < a for a, b in zip(offsets, offsets[1:])):
        raise ValueError(f"kda: cu_seqlens must be non-decreasing, got {offsets}")
    slots = state_slots.tolist()
    if any(not 0 <= s < num_slots for s in slots):
        raise ValueError(f"kda: state_slots must index rows of the state pools, [0, {num_slots}), got {slots}")
    if len(set(slots)) != len(slots):
        raise ValueError(f"kda: state_slots must be distinct (one state row per sequence), got {slots}")
    flags = has_initial_state.tolist()
    if any(f not in (0, 1) for f in flags):
        raise ValueError(f"kda: has_initial_state must hold 0 or 1, got {flags}")
    return offsets, slots, flags


def _snapshot_points(contract, snapshot_offsets, snapshot_rows, offsets, num_rows: int) -> list[dict[int, int]]:
    """Per sequence ``{token count: snapshot row}``, validated against the contract's rules."""
    name = contract.qualified_name
    points, used = [], set()
    for b, (offs, rows) in enumerate(zip(snapshot_offsets.tolist(), snapshot_rows.tolist())):
        n = offsets[b + 1] - offsets[b]
        taken = [(o, r) for o, r in zip(offs, rows) if o != -1]
        if offs[len(taken):] != [-1] * (len(offs) - len(taken)):
            raise ValueError(f"{name}: snapshot_offsets row {b} {offs}: -1 entries must come last")
        if taken and contract is KDA_DECODE:
            raise ValueError(f"{name}: takes no snapshots, got snapshot_offsets row {b} {offs} (prefill takes them)")
        for i, (o, r) in enumerate(taken):
            if not (0 < o <= n and (o % KDA_CHUNK == 0 or o == n)) or (i and o <= taken[i - 1][0]):
                raise ValueError(f"{name}: snapshot_offsets row {b} {offs}: each point must be a multiple of "
                                 f"{KDA_CHUNK} or the sequence's {n} tokens, in (0, {n}], strictly increasing")
            if not 0 <= r < num_rows or r in used:
                raise ValueError(f"{name}: snapshot_rows {r} of sequence {b}: rows must be distinct and index the "
                                 f"snapshot pools, [0, {num_rows})")
            used.add(r)
        points.append(dict(taken))
    return points


def _kda_reference(contract, recurrence, qkv, gate, beta, conv_weight, A_log, dt_bias, cu_seqlens,
                   state_slots, has_initial_state, conv_state, recurrent_state, snapshot_offsets, snapshot_rows,
                   snapshot_conv, snapshot_recurrent, num_heads, head_dim, lower_bound):
    check_attributes(num_heads, head_dim, lower_bound)
    dims = contract.check(qkv, gate, beta, conv_weight, A_log, dt_bias, cu_seqlens, state_slots,
                          has_initial_state, conv_state, recurrent_state, snapshot_offsets, snapshot_rows,
                          snapshot_conv, snapshot_recurrent, num_heads, head_dim, lower_bound)
    offsets, slots, flags = _batch_layout(cu_seqlens, state_slots, has_initial_state, dims["T"], dims["S"])
    points = _snapshot_points(contract, snapshot_offsets, snapshot_rows, offsets, dims["Ns"])
    H, K, P = dims["H"], dims["K"], dims["P"]
    act = qkv.dtype
    cd = compute_dtype(act)
    out = qkv.new_empty(dims["T"], P)
    A_log_c = A_log.to(cd)
    dt_bias_c = dt_bias.to(cd).reshape(H, K)
    for start, end, slot, continues, rows in zip(offsets, offsets[1:], slots, flags, points):
        T = end - start
        if T == 0:  # an empty sequence is a no-op (padding rows of a fixed-size batch): its slot keeps its state
            continue
        conv_y, conv_final = short_conv(
            qkv[start:end], conv_weight, conv_state[slot] if continues else None)
        # the conv output is materialised in the activation dtype (§4.5.2)
        conv_y = conv_y.to(act).to(cd)
        q, k, v = (conv_y[:, i * P:(i + 1) * P].reshape(T, H, K) for i in range(3))
        g = kda_gate(gate[start:end].to(cd).reshape(T, H, K), A_log_c, dt_bias_c, lower_bound)
        b = torch.sigmoid(beta[start:end].to(cd))
        initial = recurrent_state[slot].to(cd) if continues else None
        snapshots = dict.fromkeys(rows)
        o, final = recurrence(l2_normalize(q), l2_normalize(k), v, g, b, K ** -0.5, initial, snapshots)
        out[start:end] = o.reshape(T, P).to(act)
        # snapshots before the state row is overwritten: their conv states may reach into it
        for n, row in rows.items():
            snapshot_conv[row].copy_(conv_state_at(qkv[start:end], conv_state[slot] if continues else None,
                                                   dims["W"], n))
            snapshot_recurrent[row].copy_(snapshots[n])
        conv_state[slot].copy_(conv_final)
        recurrent_state[slot].copy_(final)
    return out


def kda_prefill(*args):
    """``k3::kda_prefill`` reference: the chunked form (C = 64)."""
    return _kda_reference(KDA_PREFILL, chunk_kda, *args)


def kda_decode(*args):
    """``k3::kda_decode`` reference: the token recurrence (any number of tokens)."""
    return _kda_reference(KDA_DECODE, recurrent_kda, *args)


def kda_fake(qkv, gate, beta, conv_weight, A_log, dt_bias, cu_seqlens, state_slots,
             has_initial_state, conv_state, recurrent_state, snapshot_offsets, snapshot_rows,
             snapshot_conv, snapshot_recurrent, num_heads, head_dim, lower_bound):
    """The output's shape and dtype, as the 1-tuple that ``registry.register`` expects."""
    return (qkv.new_empty(qkv.shape[0], num_heads * head_dim),)


registry.register(KDA_PREFILL, kda_prefill, kda_fake)
registry.register(KDA_DECODE, kda_decode, kda_fake)
