"""Mamba-2 (SSD) prefill scan and decode state update in torch, with SGLang's signatures.

Targets the Triton-only ops that `srt/layers/attention/mamba/mamba.py` (SGLang 0.5.23)
imports from `kernels/ops/mamba/triton_ops`:

- `mamba_chunk_scan_combined` (`ssd_combined.py`): packed varlen prefill. Besides the
  output (written into `out`) and the final state of every sequence, it returns what the
  `extra_buffer` radix strategy reads (`hybrid_linear_attn_backend._track_mamba_state_extend`):
  the states on the chunk grid of the packed batch, and states at arbitrary tracked ends.
- `selective_state_update` (`ssu_dispatch.py` / `mamba_ssm.py`): one (or T) decode steps,
  updating `state[state_batch_indices]` in place.
- `causal_conv1d_fn` / `causal_conv1d_update` with the signatures of
  `srt/layers/attention/mamba/causal_conv1d.py`, delegating to `patches/cpu/ops/conv1d.py`.

Layouts (SGLang's): x [b, L, H, P], dt [b, L, H], A [H], B/C [b, L, G, N], D [H] or [H, P],
SSM state [.., H, P, N]. Math in fp32 (`hybrid_kernels.mamba2`). Within a sequence the scan runs
segment by segment (segments end on the chunk grid and at tracked ends), each in the quadratic
"attention" form of SSD, so the state at every segment end is exact and cheap to keep.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from hybrid_kernels.mamba2 import (
    ScanInputs,
    discretize_dt,
    expand_groups,
    scan_segment,
    scan_sequence,
    ssd_step_ref,
)

__all__ = ["ScanInputs", "causal_conv1d_fn", "causal_conv1d_update", "discretize_dt", "expand_groups",
           "mamba_chunk_scan_combined", "scan_segment", "scan_sequence", "selective_state_update"]


def _sequence_bounds(length: int, cu_seqlens: torch.Tensor | None) -> list[tuple[int, int]]:
    if cu_seqlens is None:
        return [(0, length)]
    starts = cu_seqlens.tolist()
    return list(zip(starts[:-1], starts[1:]))


def _sequence_cuts(start: int, end: int, chunk_size: int, track_ends: list[int]) -> list[int]:
    """Offsets (from `start`) where the scan must stop: chunk-grid points, tracked ends, the end."""
    grid = range((start // chunk_size + 1) * chunk_size, end, chunk_size)
    points = {p for p in grid} | {p for p in track_ends if start < p <= end} | {end}
    return sorted(p - start for p in points if p > start)


def _row_inputs(x, dt, A, B, C, D, z, dt_bias, dt_softplus, dt_limit, row: int) -> ScanInputs:
    num_heads, head_dim = x.shape[-2:]
    D_full = None
    if D is not None:
        D_full = D.float()[:, None].expand(num_heads, head_dim) if D.dim() == 1 else D.float()
    return ScanInputs(
        x=x[row].float(), dt=discretize_dt(dt[row], dt_bias, dt_softplus, dt_limit), A=A.float(),
        B=expand_groups(B[row], num_heads), C=expand_groups(C[row], num_heads),
        D=D_full, z=None if z is None else z[row].float(),
    )


@dataclass
class ScanResult:
    """grid [b, nchunks, H, P, N]: state after token c*chunk_size-1 (grid[:, 0]: the row's
    initial state); final [b, H, P, N]: state at each row's end; seq_final [nseq, H, P, N];
    track [ntrack, H, P, N] (all fp32)."""

    grid: torch.Tensor
    final: torch.Tensor
    seq_final: torch.Tensor
    track: torch.Tensor


def ssd_scan_packed(x, dt, A, B, C, chunk_size, D=None, z=None, dt_bias=None, initial_states=None,
                    cu_seqlens=None, dt_softplus=False, dt_limit=(0.0, float("inf")), out=None,
                    track_seq_idx=None, track_end_locs=None) -> ScanResult:
    """Scan every row of x [b, L, H, P]; with cu_seqlens (b == 1) row 0 holds packed sequences.

    Writes y into `out` [b, L, H, P]. initial_states: [nseq, H, P, N] (cu_seqlens) or
    [b, H, P, N]. track_seq_idx / track_end_locs [ntrack]: sequence index and packed end
    position of each state to track.
    """
    batch, length, num_heads, head_dim = x.shape
    if cu_seqlens is not None and batch != 1:
        raise ValueError("mamba_chunk_scan_combined: cu_seqlens requires batch dimension 1")
    state_shape = (num_heads, head_dim, B.shape[-1])
    tracks = list(zip(track_seq_idx.tolist(), track_end_locs.tolist())) if track_seq_idx is not None else []
    result = _empty_result(x, batch, math.ceil(length / chunk_size), len(tracks), state_shape)
    seq_finals = []
    for row in range(batch):
        inputs = _row_inputs(x, dt, A, B, C, D, z, dt_bias, dt_softplus, dt_limit, row)
        for i, (start, end) in enumerate(_sequence_bounds(length, cu_seqlens)):
            seq_no = i if cu_seqlens is not None else row
            h0 = (initial_states[seq_no].float() if initial_states is not None
                  else x.new_zeros(state_shape, dtype=torch.float32))
            ends = [loc for s, loc in tracks if s == seq_no]
            y, states = scan_sequence(inputs.slice(start, end), h0, _sequence_cuts(start, end, chunk_size, ends))
            if out is not None:
                out[row, start:end] = y.to(out.dtype)
            _record_states(result, row, seq_no, start, states, tracks, chunk_size)
            seq_finals.append(states[end - start])
            result.final[row] = states[end - start]
    result.seq_final = torch.stack(seq_finals) if seq_finals else result.final
    return result


def _empty_result(x: torch.Tensor, batch: int, num_chunks: int, num_tracks: int, state_shape) -> ScanResult:
    zeros = lambda *lead: x.new_zeros((*lead, *state_shape), dtype=torch.float32)  # noqa: E731
    return ScanResult(grid=zeros(batch, max(1, num_chunks)), final=zeros(batch), seq_final=zeros(0),
                      track=zeros(num_tracks))


def _record_states(result: ScanResult, row: int, seq_no: int, start: int, states: dict[int, torch.Tensor],
                   tracks: list[tuple[int, int]], chunk_size: int) -> None:
    """Copy a sequence's segment-end states (keyed by offset from `start`) into the grid / tracks."""
    num_chunks = result.grid.shape[1]
    for offset, state in states.items():
        pos = start + offset
        if pos % chunk_size == 0 and pos // chunk_size < num_chunks and (offset > 0 or pos == 0):
            result.grid[row, pos // chunk_size] = state
    for k, (s, loc) in enumerate(tracks):
        if s == seq_no:
            result.track[k] = states[loc - start]


def mamba_chunk_scan_combined(x, dt, A, B, C, chunk_size, D=None, z=None, dt_bias=None,
                              initial_states=None, seq_idx=None, chunk_indices=None,
                              chunk_offsets=None, cu_seqlens=None, dt_softplus=False,
                              dt_limit=(0.0, float("inf")), out=None, return_final_states=False,
                              return_varlen_states=False, return_intermediate_states=False,
                              state_dtype=None, return_track_states=False, track_seq_idx=None,
                              track_end_locs=None):
    """Torch stand-in for `kernels/ops/mamba/triton_ops/ssd_combined.mamba_chunk_scan_combined`.

    Same arguments and return conventions. seq_idx / chunk_indices / chunk_offsets are the
    Triton kernels' view of cu_seqlens and are not needed here. The chunk-grid states
    ("intermediate states") are in state_dtype (default C's dtype), as in Triton.
    """
    if return_varlen_states and cu_seqlens is None:
        raise ValueError("cu_seqlens must be provided if return_varlen_states is True")
    if not return_varlen_states:
        cu_seqlens = None
    result = ssd_scan_packed(
        x, dt, A, B, C, chunk_size, D=D, z=z, dt_bias=dt_bias, initial_states=initial_states,
        cu_seqlens=cu_seqlens, dt_softplus=dt_softplus, dt_limit=dt_limit, out=out,
        track_seq_idx=track_seq_idx if return_track_states else None,
        track_end_locs=track_end_locs if return_track_states else None,
    )
    states = result.grid.to(state_dtype or C.dtype)
    final_states = result.final.to(state_dtype or C.dtype)
    return _select_returns(result, states, final_states, return_final_states, return_varlen_states,
                           return_intermediate_states, return_track_states, track_end_locs)


def _select_returns(result: ScanResult, states, final_states, return_final_states, return_varlen_states,
                    return_intermediate_states, return_track_states, track_end_locs):
    """The return tuple of `mamba_chunk_scan_combined` for the given flags (as in Triton)."""
    varlen_states = result.seq_final
    if return_track_states:
        if not return_varlen_states:
            raise ValueError("return_track_states requires return_varlen_states (cu_seqlens mode)")
        has_tracks = track_end_locs is not None and track_end_locs.numel() > 0
        return states, varlen_states, (result.track.unsqueeze(0) if has_tracks else None)
    if return_intermediate_states:
        if return_varlen_states:
            return (states, final_states, varlen_states) if return_final_states else (states, varlen_states)
        return (states, final_states) if return_final_states else states
    if not return_varlen_states:
        return final_states if return_final_states else None
    return (final_states, varlen_states) if return_final_states else varlen_states


def selective_state_update(state, x, dt, A, B, C, D=None, z=None, dt_bias=None, dt_softplus=False,
                           state_batch_indices=None, pad_slot_id=-1, out=None,
                           disable_state_update=False, intermediate_states_buffer=None,
                           cache_steps=None, retrieve_parent_token=None,
                           intermediate_state_indices=None):
    """Torch stand-in for `triton_ops.selective_state_update` (decode; T steps per request).

    state [slots, H, P, N] (updated in place at state_batch_indices unless
    disable_state_update); x / dt / z / out [b, H, P] or [b, T, H, P]; A [H, P, N];
    B, C [b, G, N] or [b, T, G, N]; D, dt_bias [H, P]. Rows whose slot is pad_slot_id are
    skipped. Speculative-decoding buffers are not supported on CPU.
    """
    if intermediate_states_buffer is not None or retrieve_parent_token is not None:
        raise NotImplementedError(
            "selective_state_update: speculative-decoding buffers (intermediate_states_buffer, "
            "retrieve_parent_token) have no CPU fallback in sglang_ext"
        )
    if out is None:
        raise ValueError("selective_state_update: `out` (preallocated output) is required")
    steps = _as_steps(x, dt, B, C, z, out)
    slots = state_batch_indices.tolist() if state_batch_indices is not None else list(range(x.shape[0]))
    for row, slot in enumerate(slots):
        if slot == pad_slot_id:
            continue
        h = state[slot].float()
        for t in range(steps.x.shape[1]):
            y, h = _ssu_step(h, steps, row, t, A, D, dt_bias, dt_softplus)
            steps.out[row, t] = y.to(steps.out.dtype)
        if not disable_state_update:
            state[slot] = h.to(state.dtype)
    return out


@dataclass
class _Steps:
    """Decode inputs viewed as [b, T, ...]."""

    x: torch.Tensor
    dt: torch.Tensor
    B: torch.Tensor
    C: torch.Tensor
    z: torch.Tensor | None
    out: torch.Tensor


def _as_steps(x, dt, B, C, z, out) -> _Steps:
    multi = x.dim() == 4
    add_t = (lambda t: t) if multi else (lambda t: None if t is None else t.unsqueeze(1))  # noqa: E731
    return _Steps(x=add_t(x), dt=add_t(dt), B=add_t(B), C=add_t(C), z=add_t(z), out=add_t(out))


def _ssu_step(h, steps: _Steps, row: int, t: int, A, D, dt_bias, dt_softplus):
    """One recurrence step: h [H, P, N] fp32 -> (y [H, P], h')."""
    num_heads = h.shape[0]
    dt = discretize_dt(steps.dt[row, t], dt_bias, dt_softplus)               # [H, P]
    B = expand_groups(steps.B[row, t], num_heads)                           # [H, N]
    C = expand_groups(steps.C[row, t], num_heads)
    z = None if steps.z is None else steps.z[row, t]
    return ssd_step_ref(h, steps.x[row, t], dt, A, B, C, D, z)


def causal_conv1d_fn(x, weight, bias=None, query_start_loc=None, cache_indices=None,
                     has_initial_state=None, conv_states=None, activation="silu", pad_slot_id=-1,
                     **kwargs):
    """`srt/layers/attention/mamba/causal_conv1d.causal_conv1d_fn` on CPU (varlen prefill).

    x [D, total_T] packed by query_start_loc [nseq+1]; weight [D, W]; conv_states
    [slots, D, W-1] updated in place at cache_indices. Returns the conv output [D, total_T].
    (`seq_lens_cpu`, a Triton launch hint, is accepted and unused.)
    """
    from sglang_ext.patches.cpu.ops.conv1d import causal_conv1d_fwd_cpu

    unknown = set(kwargs) - {"seq_lens_cpu"}
    if unknown:
        raise NotImplementedError(f"causal_conv1d_fn: arguments {sorted(unknown)} have no CPU fallback")
    if query_start_loc is None:
        raise NotImplementedError("causal_conv1d_fn without query_start_loc (batched x) has no CPU fallback")
    return causal_conv1d_fwd_cpu(x, weight, bias, conv_states, query_start_loc, cache_indices,
                                 has_initial_state, activation in ("silu", "swish"), pad_slot_id)


def causal_conv1d_update(x, conv_state, weight, bias=None, activation=None, cache_seqlens=None,
                         conv_state_indices=None, pad_slot_id=-1, **kwargs):
    """`srt/layers/attention/mamba/causal_conv1d.causal_conv1d_update` on CPU (decode).

    x [b, D] or [b, D, T]; conv_state [slots, D, W-1] updated in place at conv_state_indices.
    The speculative-decoding arguments of the Triton variant are not supported.
    """
    from sglang_ext.patches.cpu.ops.conv1d import causal_conv1d_update_cpu

    given = sorted(k for k, v in kwargs.items() if v is not None)
    if given:
        raise NotImplementedError(f"causal_conv1d_update: arguments {given} (speculative decoding) "
                                  "have no CPU fallback in sglang_ext")
    return causal_conv1d_update_cpu(x, conv_state, weight, bias, activation in ("silu", "swish"),
                                    cache_seqlens, conv_state_indices, pad_slot_id)
