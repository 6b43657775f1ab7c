"""Linear-state algebra for LinearKV, dispatched on the layer kind ("gdn" | "mamba2").

Thin wrappers over `hybrid_kernels`: on CUDA tensors its Triton kernels, elsewhere their pure-torch
twins (same signatures and results). State conventions: GDN S [H, dk, dv] with
S_t = exp(g_t)(I - b_t k_t k_t^T) S_{t-1} + b_t k_t v_t^T, so a chunk maps S -> M S + s with
M [H, dk, dk]; Mamba-2 h [H, head_dim, d_state] with h -> a h + s, a [H]. Composition is fp32.
"""

from __future__ import annotations

import importlib
from collections.abc import Sequence

import torch

KINDS = ("gdn", "mamba2")


def _op(package: str, name: str, on: torch.Tensor):
    """`hybrid_kernels.<package>.<name>` (Triton) for CUDA tensors, else its `<name>_ref` twin."""
    module = importlib.import_module(f"hybrid_kernels.{package}")
    return getattr(module, name if on.is_cuda else f"{name}_ref")


def compose(kind: str, states: Sequence[torch.Tensor], transitions: Sequence[torch.Tensor],
            initial: torch.Tensor | None = None) -> torch.Tensor:
    """Fold chunk end states in order: S <- T_i S + s_i from `initial` (zero when None).

    states[i]: chunk i's end state from zero; transitions[i]: its transition. Returns fp32."""
    if len(states) != len(transitions):
        raise ValueError(f"compose: {len(states)} states but {len(transitions)} transitions")
    if not states:
        raise ValueError("compose: no chunks")
    if any(t is None for t in transitions):
        raise ValueError("compose: a chunk has no transition (register it with transitions)")
    s = torch.stack([x.float() for x in states])
    t = torch.stack([x.float() for x in transitions])
    init = None if initial is None else initial.float()
    if kind == "gdn":
        return _op("gdn", "gdn_compose", s)(s, t, initial=init)
    if kind == "mamba2":
        return _op("mamba2", "mamba2_compose", s)(s, t, initial=init)
    raise ValueError(f"unknown linear layer kind {kind!r}; choose from {KINDS}")


def mamba2_chunk_decay(dt: torch.Tensor, A: torch.Tensor) -> torch.Tensor:
    """Per-head decay exp(A * sum_t dt_t) of a chunk; dt [T, H] after softplus + bias + clamp."""
    return _op("mamba2", "mamba2_chunk_decay", dt)(dt.float(), A.float())


def rerotate_keys(k: torch.Tensor, delta: int, rotary_dim: int, base: float, neox: bool = True) -> torch.Tensor:
    """Keys k [T, H, D] rotated at positions p moved to p + delta (first `rotary_dim` dims)."""
    return _op("rope", "rerotate_keys", k)(k, delta, rotary_dim, base, neox=neox)
