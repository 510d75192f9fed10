"""Readable KDA math (spec §4.5): gate, l2-norm, short conv, token recurrence, chunked form.

One sequence at a time, plain torch, any float dtype. The two recurrence forms take
identical arguments and return identical things so that either can stand in for the
other; ``chunk_kda`` is what prefill kernels compute, ``recurrent_kda`` is the exact
definition. States are K-major ``[H, K, V]`` (FLA convention, the layout of the
contract's ``recurrent_state``): ``S = Mᵀ`` with ``M`` the V-major state of §4.5.6.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ..common import compute_dtype


def kda_gate(
    gate_raw: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor, lower_bound: float
) -> torch.Tensor:
    """Log-decay ``g [T, H, K]`` from the raw gate projection (§4.5.3), in gate_raw's dtype.

    ``A_log [H]``, ``dt_bias [H, K]``. ``lower_bound < 0`` selects the bounded gate
    ``lb·σ(exp(A_log)·z)``; ``0.0`` selects ``−exp(A_log)·softplus(z)``.
    """
    dtype = gate_raw.dtype
    z = gate_raw + dt_bias.to(dtype)
    a = torch.exp(A_log.to(dtype))[:, None]  # [H, 1]: one rate per head, all key channels
    if lower_bound < 0:
        return lower_bound * torch.sigmoid(a * z)
    if lower_bound == 0.0:
        # torch's softplus returns z itself above 20, as the reference kernels do
        return -a * F.softplus(z)
    raise ValueError(f"lower_bound must be < 0 (bounded gate) or 0.0 (softplus gate), got {lower_bound}")


def l2_normalize(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """``x / sqrt(Σ x² + eps)`` over the last dim (eps inside the root, §7.5)."""
    return x / torch.sqrt(x.pow(2).sum(-1, keepdim=True) + eps)


def short_conv(
    x: torch.Tensor, weight: torch.Tensor, initial: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """SiLU of the causal depthwise conv (§4.5.2) of ``x [T, C]`` with taps ``weight [C, W]``.

    ``initial [C, W-1]`` holds the raw inputs before ``x`` (oldest first); ``None`` means
    zeros. Returns ``y [T, C]`` in the compute dtype (the caller rounds it) and the new
    conv state ``[C, W-1]``: the last ``W-1`` raw inputs in x's dtype, which include
    values of ``initial`` when ``T < W-1``.
    """
    T, C = x.shape
    W = weight.shape[1]
    cd = compute_dtype(x.dtype)
    if initial is None:
        initial = x.new_zeros(C, W - 1)
    history = torch.cat([initial.to(x.dtype).T, x], dim=0)  # [W-1+T, C] raw inputs
    h, w = history.to(cd), weight.to(cd)
    # tap j sees token t-(W-1)+j, i.e. history row t+j; tap W-1 is the current token
    y = F.silu(sum(w[:, j] * h[j:j + T] for j in range(W)))
    final_state = history[history.shape[0] - (W - 1):].T.contiguous()
    return y, final_state


def conv_state_at(x: torch.Tensor, initial: torch.Tensor | None, W: int, tokens: int) -> torch.Tensor:
    """The conv state ``[C, W-1]`` after the first ``tokens`` rows of ``x [T, C]``: the W-1 raw
    inputs before row ``tokens`` (from ``initial``, or zeros, where they precede ``x``), in x's
    dtype; ``short_conv``'s final state when ``tokens == T``."""
    if initial is None:
        initial = x.new_zeros(x.shape[1], W - 1)
    history = torch.cat([initial.to(x.dtype).T, x[:tokens]], dim=0)
    return history[tokens:].T.contiguous()


def _zero_state_if_none(initial_state, q, v):
    H, K = q.shape[1], q.shape[2]
    if initial_state is None:
        return q.new_zeros(H, K, v.shape[2])
    return initial_state.to(q.dtype).clone()


def recurrent_kda(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: float,
    initial_state: torch.Tensor | None,
    snapshots: dict[int, torch.Tensor | None] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Token-by-token gated delta rule (§4.5.6), computed in q's dtype.

    q, k ``[T, H, K]`` already l2-normalised (q is multiplied by ``scale`` here),
    v ``[T, H, V]``, g ``[T, H, K]`` log-decay, beta ``[T, H]``, initial_state
    ``[H, K, V]`` or None. Returns ``o [T, H, V]`` and the final state ``[H, K, V]``.
    ``snapshots``: its keys are token counts in [1, T]; each value becomes the state after
    that many tokens (the prefix cache's snapshots).
    """
    dtype = q.dtype
    k, v, g, beta = (t.to(dtype) for t in (k, v, g, beta))
    S = _zero_state_if_none(initial_state, q, v)
    o = q.new_empty(q.shape[0], q.shape[1], v.shape[2])
    for t in range(q.shape[0]):
        S = S * torch.exp(g[t])[:, :, None]
        predicted = torch.einsum("hk,hkv->hv", k[t], S)
        u = beta[t][:, None] * (v[t] - predicted)
        S = S + k[t][:, :, None] * u[:, None, :]
        o[t] = torch.einsum("hk,hkv->hv", q[t] * scale, S)
        if snapshots is not None and t + 1 in snapshots:
            snapshots[t + 1] = S.clone()
    _check_snapshots_taken(snapshots)
    return o, S


def _forward_substitution(strict_lower: torch.Tensor, rhs: torch.Tensor) -> torch.Tensor:
    """Solve ``(I + L) X = rhs`` for strictly lower-triangular ``L [H, n, n]``, ``rhs [H, n, D]``."""
    x = rhs.clone()
    for r in range(1, rhs.shape[1]):
        x[:, r] = rhs[:, r] - torch.einsum("hj,hjd->hd", strict_lower[:, r, :r], x[:, :r])
    return x


def chunk_kda(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: float,
    initial_state: torch.Tensor | None,
    snapshots: dict[int, torch.Tensor | None] | None = None,
    chunk_size: int = 64,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Chunked gated delta rule (§4.5.7): same arguments and results as ``recurrent_kda``.

    Within a chunk of n tokens (the last may be shorter) the intra-chunk interactions
    are two n×n matrices and a unit lower-triangular solve; the state is carried only
    across chunk boundaries, so ``snapshots`` may only ask for those (multiples of
    ``chunk_size``) and for T.
    """
    dtype = q.dtype
    # head-major views [H, T, ·] so that every chunk is a batch of per-head matrices
    qh, kh, vh, gh = (t.to(dtype).transpose(0, 1) for t in (q * scale, k, v, g))
    bh = beta.to(dtype).T
    S = _zero_state_if_none(initial_state, q, v)
    o = q.new_empty(q.shape[1], q.shape[0], v.shape[2])
    for start in range(0, q.shape[0], chunk_size):
        end = min(start + chunk_size, q.shape[0])
        n = end - start
        Qc, Kc, Vc, bc = qh[:, start:end], kh[:, start:end], vh[:, start:end], bh[:, start:end]
        gamma = gh[:, start:end].cumsum(1)  # [H, n, K] Γ_r
        # exponent Γ_r − Γ_j for every (r, j); masked to −inf before exp so the
        # upper triangle (unbounded positive exponents) never becomes inf (§7.3)
        diff = gamma[:, :, None, :] - gamma[:, None, :, :]  # [H, n(r), n(j), K]
        rows = torch.arange(n, device=q.device)
        causal = rows[:, None] >= rows[None, :]
        strict = rows[:, None] > rows[None, :]
        decay_causal = torch.exp(diff.masked_fill(~causal[None, :, :, None], float("-inf")))
        decay_strict = torch.exp(diff.masked_fill(~strict[None, :, :, None], float("-inf")))
        A_kk = bc[:, :, None] * torch.einsum("hrk,hjk,hrjk->hrj", Kc, Kc, decay_strict)
        A_qk = torch.einsum("hrk,hjk,hrjk->hrj", Qc, Kc, decay_causal)
        # Tm = (I + A_kk)^{-1} diag(β), applied to [exp(Γ)⊙K | V] in one solve
        rhs = bc[:, :, None] * torch.cat([torch.exp(gamma) * Kc, Vc], dim=-1)
        solved = _forward_substitution(A_kk, rhs)
        Wc, Uc = solved[..., : Kc.shape[-1]], solved[..., Kc.shape[-1]:]
        new_values = Uc - Wc @ S  # U' [H, n, V]
        o[:, start:end] = (Qc * torch.exp(gamma)) @ S + A_qk @ new_values
        gamma_last = gamma[:, -1:, :]  # [H, 1, K] Γ_n
        S = torch.exp(gamma_last).transpose(1, 2) * S + (
            Kc * torch.exp(gamma_last - gamma)
        ).transpose(1, 2) @ new_values
        if snapshots is not None and end in snapshots:
            snapshots[end] = S.clone()
    _check_snapshots_taken(snapshots)
    return o.transpose(0, 1), S


def _check_snapshots_taken(snapshots: dict[int, torch.Tensor | None] | None) -> None:
    missed = sorted(n for n, s in (snapshots or {}).items() if s is None)
    if missed:
        raise ValueError(f"kda: no state after {missed} tokens (not a chunk boundary or past the sequence)")
