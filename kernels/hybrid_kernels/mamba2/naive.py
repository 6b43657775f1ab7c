"""Mamba-2 (SSD) in pure torch: segment scan, decode step, chunk decay and state composition.

Layouts (SGLang's / mamba_ssm's): per sequence x [T, H, P] (P = head_dim), dt [T, H] (after bias,
softplus and clamp: `discretize_dt`), A [H] (negative), B, C [T, H, N] (groups expanded to heads:
`expand_groups`), D [H, P] or None, z [T, H, P] or None; SSM state h [H, P, N] (N = d_state), fp32.

Recurrence: h_t = exp(dt_t A) h_{t-1} + dt_t x_t B_t^T,  y_t = h_t C_t + D x_t  (times silu(z_t)).
The scan runs in the quadratic "attention" form of SSD per segment (exact state at each segment end).

Exact composition (LinearKV / HYPIC): a chunk maps h_start -> a h_start + s with a per-head scalar
a = exp(A sum_t dt_t) (`mamba2_chunk_decay_ref`) and s its end state from zero; chunks in order
compose by h <- a_i h + s_i (`mamba2_compose_ref`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass
class ScanInputs:
    """One row's (or one sequence's) discretized inputs, fp32.

    x [T, H, P]; dt [T, H] (after bias/softplus/clamp); A [H]; B, C [T, H, N] (groups
    expanded to heads); D [H, P] or None; z [T, H, P] or None.
    """

    x: torch.Tensor
    dt: torch.Tensor
    A: torch.Tensor
    B: torch.Tensor
    C: torch.Tensor
    D: torch.Tensor | None
    z: torch.Tensor | None

    def slice(self, start: int, end: int) -> "ScanInputs":
        cut = lambda t: None if t is None else t[start:end]  # noqa: E731
        return ScanInputs(cut(self.x), cut(self.dt), self.A, cut(self.B), cut(self.C), self.D, cut(self.z))


def discretize_dt(dt: torch.Tensor, dt_bias: torch.Tensor | None, softplus: bool,
                  dt_limit: tuple[float, float] = (0.0, float("inf"))) -> torch.Tensor:
    """dt [..., H] (or [..., H, P]) -> fp32 time step: + bias, softplus, clamp to dt_limit."""
    dt = dt.float()
    if dt_bias is not None:
        dt = dt + dt_bias.float()
    if softplus:
        dt = F.softplus(dt)
    if dt_limit != (0.0, float("inf")):
        dt = dt.clamp(min=dt_limit[0], max=dt_limit[1])
    return dt


def expand_groups(t: torch.Tensor, num_heads: int) -> torch.Tensor:
    """[..., G, N] -> [..., H, N]: head h reads group h // (H // G)."""
    return t.float().repeat_interleave(num_heads // t.shape[-2], dim=-2)


def scan_segment(seg: ScanInputs, h0: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """SSD over one segment, quadratic form. h0 [H, P, N] fp32 -> (y [T, H, P], h_end [H, P, N]).

    y_t = sum_{s<=t} (C_t . B_s) exp(cum_t - cum_s) dt_s x_s + C_t . (exp(cum_t) h0) + D x_t,
    h_end = exp(cum_T) h0 + sum_s exp(cum_T - cum_s) dt_s B_s x_s^T, where cum = cumsum(dt A).
    """
    cum = torch.cumsum(seg.dt * seg.A.float(), dim=0)                       # [T, H]
    diff = cum[:, None, :] - cum[None, :, :]                                 # [T, S, H]
    causal = torch.ones(diff.shape[:2], dtype=torch.bool, device=diff.device).tril()
    decay = torch.exp(diff.masked_fill(~causal[..., None], float("-inf")))  # [T, S, H]
    scores = torch.einsum("thn,shn->tsh", seg.C, seg.B) * decay * seg.dt[None]
    y = torch.einsum("tsh,shp->thp", scores, seg.x)
    y = y + torch.einsum("thn,hpn->thp", seg.C, h0) * torch.exp(cum)[..., None]
    weights = torch.exp(cum[-1:] - cum) * seg.dt                             # [T, H]
    h_end = h0 * torch.exp(cum[-1])[:, None, None] + torch.einsum("th,thn,thp->hpn", weights, seg.B, seg.x)
    if seg.D is not None:
        y = y + seg.x * seg.D
    if seg.z is not None:
        y = y * F.silu(seg.z)
    return y, h_end


def scan_sequence(seq: ScanInputs, h0: torch.Tensor, cuts: list[int]
                  ) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
    """Scan one sequence, cutting it at the (sorted, in (0, T]) offsets `cuts`.

    h0 [H, P, N] fp32 -> (y [T, H, P], {cut: state after the first `cut` tokens}).
    """
    ys, states, start, h = [], {0: h0}, 0, h0
    for end in cuts:
        y, h = scan_segment(seq.slice(start, end), h)
        ys.append(y)
        states[end] = h
        start = end
    y = torch.cat(ys) if ys else seq.x.new_zeros(seq.x.shape)
    return y, states


def ssd_step_ref(h: torch.Tensor, x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor,
                 C: torch.Tensor, D: torch.Tensor | None = None, z: torch.Tensor | None = None
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """One decode step: h [H, P, N]; x [H, P]; dt [H, P] (discretized); A broadcastable to [H, P, N];
    B, C [H, N]; D [H, P] or None; z [H, P] or None. Returns (y [H, P], new h), fp32."""
    x, dt = x.float(), dt.float()
    h = h.float() * torch.exp(dt[..., None] * A.float()) + (dt * x)[..., None] * B.float()[:, None, :]
    y = torch.einsum("hpn,hn->hp", h, C.float())
    if D is not None:
        y = y + x * D.float()
    if z is not None:
        y = y * F.silu(z.float())
    return y, h


def mamba2_chunk_decay_ref(dt: torch.Tensor, A: torch.Tensor) -> torch.Tensor:
    """dt [T, H] (discretized: after bias, softplus, clamp), A [H] (negative) -> a [H] fp32 =
    exp(A * sum_t dt_t): the factor by which a chunk scales the state it starts from. T = 0 gives 1."""
    return torch.exp(A.float() * dt.float().sum(0))


def mamba2_compose_ref(states: torch.Tensor, decays: torch.Tensor, initial: torch.Tensor | None = None
                       ) -> torch.Tensor:
    """Exact composition of K chunks in order: states [K, H, P, N] (each chunk's end state from zero),
    decays [K, H]; initial [H, P, N] or None (zero). Returns h [H, P, N] fp32 from h = initial;
    for i in 0..K-1: h <- a_i h + s_i."""
    if states.shape[0] != decays.shape[0]:
        raise ValueError(f"mamba2_compose_ref: {states.shape[0]} states but {decays.shape[0]} decays")
    h = states.new_zeros(states.shape[1:], dtype=torch.float32) if initial is None else initial.float()
    for s_i, a_i in zip(states.float(), decays.float()):
        h = a_i[:, None, None] * h + s_i
    return h
