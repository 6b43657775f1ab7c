"""Decode-time state tracking for the `extra_buffer` Mamba strategy, in torch.

Targets `kernels/ops/mamba/mamba_state_scatter_triton.py` (SGLang 0.5.23):
`track_mamba_states_if_needed` (one layer's pools) and `track_mamba_states_all_layers` (the
[layers, slots, ...] pools in one call), Triton kernels that `hybrid_linear_attn_backend.py`
calls after each decode step of a GDN / Mamba-2 layer. Contract (the kernels' docstrings):
for every batch row i < batch_size with mamba_track_mask[i] set, copy the conv and SSM state
rows of slot cache_indices[i] to slot mamba_track_indices[i] (in every layer); with
check_freed_slots, rows whose source or destination is -1 are skipped.
"""

from __future__ import annotations

import torch


def _tracked_rows(cache_indices: torch.Tensor, mamba_track_mask: torch.Tensor,
                  mamba_track_indices: torch.Tensor, batch_size: int,
                  check_freed_slots: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(source slots, destination slots) of the rows to copy, int64."""
    rows = mamba_track_mask[:batch_size].to(torch.bool).nonzero().squeeze(-1)
    src = cache_indices[rows].long()
    dst = mamba_track_indices[rows].long()
    if check_freed_slots:
        live = (src >= 0) & (dst >= 0)
        src, dst = src[live], dst[live]
    return src, dst


def track_mamba_states_if_needed(conv_states: torch.Tensor, ssm_states: torch.Tensor,
                                 cache_indices: torch.Tensor, mamba_track_mask: torch.Tensor,
                                 mamba_track_indices: torch.Tensor, batch_size: int,
                                 check_freed_slots: bool = False) -> None:
    """conv_states [slots, ...], ssm_states [slots, ...] of one layer, updated in place."""
    src, dst = _tracked_rows(cache_indices, mamba_track_mask, mamba_track_indices, batch_size,
                             check_freed_slots)
    if src.numel():
        conv_states[dst] = conv_states[src]
        ssm_states[dst] = ssm_states[src]


def track_mamba_states_all_layers(conv_states_pool: torch.Tensor, ssm_states_pool: torch.Tensor,
                                  cache_indices: torch.Tensor, mamba_track_mask: torch.Tensor,
                                  mamba_track_indices: torch.Tensor, batch_size: int,
                                  check_freed_slots: bool = False) -> None:
    """conv / ssm pools [layers, slots, ...], updated in place in every layer."""
    src, dst = _tracked_rows(cache_indices, mamba_track_mask, mamba_track_indices, batch_size,
                             check_freed_slots)
    if src.numel():
        conv_states_pool[:, dst] = conv_states_pool[:, src]
        ssm_states_pool[:, dst] = ssm_states_pool[:, src]
