"""Mamba-2 CPU ops (SGLang signatures: packed sequences, pool slots, chunk-grid and tracked states)
vs independent references: a token-by-token recurrence written here and transformers' torch paths.
The math itself: tests/kernels/."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from transformers.models.nemotron_h.modeling_nemotron_h import (
    causal_conv1d_fn as hf_causal_conv1d_fn,
)
from transformers.models.nemotron_h.modeling_nemotron_h import (
    mamba2_chunk_scan,
    mamba2_selective_state_update,
)

from sglang_ext.patches.cpu.ops.mamba2 import (
    causal_conv1d_fn,
    causal_conv1d_update,
    mamba_chunk_scan_combined,
    selective_state_update,
)

H, P, N, G = 4, 8, 16, 2
CHUNK = 16
ATOL = 1e-4


def _inputs(total: int, seed: int = 0, batch: int = 1) -> dict:
    gen = torch.Generator().manual_seed(seed)
    return dict(
        x=torch.randn(batch, total, H, P, generator=gen),
        dt=torch.randn(batch, total, H, generator=gen) - 1.0,
        A=-torch.rand(H, generator=gen) * 2 - 0.1,
        B=torch.randn(batch, total, G, N, generator=gen),
        C=torch.randn(batch, total, G, N, generator=gen),
        D=torch.randn(H, generator=gen),
        dt_bias=torch.randn(H, generator=gen) * 0.5,
    )


def _recurrence(x, dt, A, B, C, D, dt_bias, h0):
    """Token by token: x [T, H, P] ... -> (y [T, H, P], states [T+1, H, P, N]: after t tokens)."""
    dt = F.softplus(dt + dt_bias)                                  # [T, H]
    B = B.repeat_interleave(H // G, dim=1)                         # [T, H, N]
    C = C.repeat_interleave(H // G, dim=1)
    h, ys, states = h0.clone(), [], [h0.clone()]
    for t in range(x.shape[0]):
        h = h * torch.exp(dt[t] * A)[:, None, None] + (dt[t][:, None] * x[t])[..., None] * B[t][:, None, :]
        ys.append(torch.einsum("hpn,hn->hp", h, C[t]) + D[:, None] * x[t])
        states.append(h.clone())
    return torch.stack(ys), torch.stack(states)


def _cu(lengths):
    return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)


def _packed_reference(inp, lengths, initial):
    """Per-sequence recurrences over the packed row -> (y [T, H, P], [states per sequence])."""
    starts = _cu(lengths).tolist()
    ys, states = [], []
    for i, (s, e) in enumerate(zip(starts[:-1], starts[1:])):
        y, st = _recurrence(inp["x"][0, s:e], inp["dt"][0, s:e], inp["A"], inp["B"][0, s:e],
                            inp["C"][0, s:e], inp["D"], inp["dt_bias"], initial[i])
        ys.append(y)
        states.append(st)
    return torch.cat(ys), states


def _grid_reference(lengths, seq_states, initial):
    """State after token c*CHUNK-1 of the sequence owning it; grid[0] = first initial state."""
    starts = _cu(lengths).tolist()
    total = starts[-1]
    grid = [initial[0]]
    for pos in range(CHUNK, -(-total // CHUNK) * CHUNK, CHUNK):
        seq = max(i for i in range(len(lengths)) if starts[i] < pos)
        grid.append(seq_states[seq][pos - starts[seq]])
    return torch.stack(grid)


def _initial_states(num_seqs, with_initial_state, seed=1):
    gen = torch.Generator().manual_seed(seed)
    if not with_initial_state:
        return None, torch.zeros(num_seqs, H, P, N)
    init = torch.randn(num_seqs, H, P, N, generator=gen)
    return init, init


@pytest.mark.parametrize("lengths", [[1], [15], [16], [37, 5, 70], [100, 16, 3, 33]])
@pytest.mark.parametrize("with_initial_state", [False, True])
def test_packed_scan_matches_recurrence(lengths, with_initial_state):
    total = sum(lengths)
    inp = _inputs(total, seed=len(lengths) + total)
    init, ref_init = _initial_states(len(lengths), with_initial_state)
    starts = _cu(lengths)
    # track one state per sequence at an off-grid end (and one at its very start)
    track_seq = torch.tensor([i for i in range(len(lengths)) for _ in range(2)])
    track_end = torch.tensor([v for i, n in enumerate(lengths)
                              for v in (int(starts[i]), int(starts[i]) + (n * 2) // 3)])
    out = torch.full((1, total, H, P), float("nan"))
    grid, varlen, track = mamba_chunk_scan_combined(
        inp["x"], inp["dt"], inp["A"], inp["B"], inp["C"], CHUNK, D=inp["D"], dt_bias=inp["dt_bias"],
        initial_states=init, cu_seqlens=starts, dt_softplus=True, out=out,
        return_varlen_states=True, return_track_states=True, track_seq_idx=track_seq,
        track_end_locs=track_end, state_dtype=torch.float32)

    ref_y, ref_states = _packed_reference(inp, lengths, ref_init)
    torch.testing.assert_close(out[0], ref_y, atol=ATOL, rtol=ATOL)
    torch.testing.assert_close(varlen, torch.stack([s[-1] for s in ref_states]), atol=ATOL, rtol=ATOL)
    assert grid.shape == (1, -(-total // CHUNK), H, P, N)
    torch.testing.assert_close(grid[0], _grid_reference(lengths, ref_states, ref_init), atol=ATOL, rtol=ATOL)
    ref_track = torch.stack([ref_states[s][e - int(starts[s])] for s, e in zip(track_seq.tolist(), track_end.tolist())])
    torch.testing.assert_close(track[0], ref_track, atol=ATOL, rtol=ATOL)


@pytest.mark.parametrize("length", [7, 64, 129])
@pytest.mark.parametrize("with_initial_state", [False, True])
def test_batched_scan_matches_transformers(length, with_initial_state):
    """Rows as independent sequences (no cu_seqlens), against transformers' chunked torch scan."""
    inp = _inputs(length, seed=length, batch=2)
    init, _ = _initial_states(2, with_initial_state)
    out = torch.empty(2, length, H, P)
    final = mamba_chunk_scan_combined(
        inp["x"], inp["dt"], inp["A"], inp["B"], inp["C"], CHUNK, D=inp["D"], dt_bias=inp["dt_bias"],
        initial_states=init, dt_softplus=True, out=out, return_final_states=True)
    ref_y, ref_final = mamba2_chunk_scan(
        inp["x"], inp["dt"], inp["A"], inp["B"], inp["C"], chunk_size=32, D=inp["D"],
        dt_bias=inp["dt_bias"], initial_states=init, dt_softplus=True, return_final_states=True)
    torch.testing.assert_close(out, ref_y, atol=ATOL, rtol=ATOL)
    torch.testing.assert_close(final, ref_final, atol=ATOL, rtol=ATOL)


def test_scan_applies_dt_limit_and_gate():
    inp = _inputs(20, seed=3)
    z = torch.randn(1, 20, H, P)
    out = torch.empty(1, 20, H, P)
    mamba_chunk_scan_combined(inp["x"], inp["dt"], inp["A"], inp["B"], inp["C"], CHUNK, D=inp["D"], z=z,
                              dt_bias=inp["dt_bias"], dt_softplus=True, dt_limit=(0.3, 0.5), out=out)
    ref_y = mamba2_chunk_scan(inp["x"], inp["dt"], inp["A"], inp["B"], inp["C"], chunk_size=CHUNK, D=inp["D"],
                              dt_bias=inp["dt_bias"], dt_softplus=True, dt_limit=(0.3, 0.5))
    torch.testing.assert_close(out, ref_y * F.silu(z), atol=ATOL, rtol=ATOL)


def _decode_inputs(batch, steps, seed):
    gen = torch.Generator().manual_seed(seed)
    shape = (batch, steps) if steps else (batch,)
    return dict(
        x=torch.randn(*shape, H, P, generator=gen),
        dt=(torch.randn(*shape, H, generator=gen) - 1.0)[..., None].expand(*shape, H, P),
        B=torch.randn(*shape, G, N, generator=gen),
        C=torch.randn(*shape, G, N, generator=gen),
    )


def _decode_params(seed=5):
    gen = torch.Generator().manual_seed(seed)
    A = -torch.rand(H, generator=gen) - 0.1
    return dict(A=A[:, None, None].expand(H, P, N), D=torch.randn(H, generator=gen)[:, None].expand(H, P),
                dt_bias=torch.randn(H, generator=gen)[:, None].expand(H, P))


def test_selective_state_update_matches_transformers_and_skips_padding():
    inp, par = _decode_inputs(3, 0, seed=7), _decode_params()
    pool = torch.randn(6, H, P, N)
    before = pool.clone()
    slots = torch.tensor([4, -1, 1])
    out = torch.full((3, H, P), float("nan"))
    selective_state_update(pool, inp["x"], inp["dt"], par["A"], inp["B"], inp["C"], par["D"],
                           dt_bias=par["dt_bias"], dt_softplus=True, state_batch_indices=slots, out=out)
    for row, slot in ((0, 4), (2, 1)):
        ref_state = before[slot : slot + 1].clone()
        ref_y = mamba2_selective_state_update(
            ref_state, inp["x"][row : row + 1], inp["dt"][row : row + 1], par["A"], inp["B"][row : row + 1],
            inp["C"][row : row + 1], par["D"], dt_bias=par["dt_bias"], dt_softplus=True)
        torch.testing.assert_close(out[row], ref_y[0], atol=ATOL, rtol=ATOL)
        torch.testing.assert_close(pool[slot], ref_state[0], atol=ATOL, rtol=ATOL)
    untouched = [s for s in range(6) if s not in (4, 1)]
    assert torch.equal(pool[untouched], before[untouched])
    assert torch.isnan(out[1]).all()


@pytest.mark.parametrize("disable_state_update", [False, True])
def test_multi_step_update_matches_recurrence(disable_state_update):
    steps = 5
    inp, par = _decode_inputs(2, steps, seed=9), _decode_params()
    pool = torch.randn(4, H, P, N)
    before = pool.clone()
    slots = torch.tensor([3, 0])
    out = torch.empty(2, steps, H, P)
    selective_state_update(pool, inp["x"], inp["dt"], par["A"], inp["B"], inp["C"], par["D"],
                           dt_bias=par["dt_bias"], dt_softplus=True, state_batch_indices=slots, out=out,
                           disable_state_update=disable_state_update)
    for row, slot in enumerate(slots.tolist()):
        ref_y, ref_states = _recurrence(inp["x"][row], inp["dt"][row, :, :, 0], par["A"][:, 0, 0],
                                        inp["B"][row], inp["C"][row], par["D"][:, 0], par["dt_bias"][:, 0],
                                        before[slot])
        torch.testing.assert_close(out[row], ref_y, atol=ATOL, rtol=ATOL)
        expected = before[slot] if disable_state_update else ref_states[-1]
        torch.testing.assert_close(pool[slot], expected, atol=ATOL, rtol=ATOL)


def test_speculative_buffers_are_refused():
    inp, par = _decode_inputs(1, 0, seed=1), _decode_params()
    with pytest.raises(NotImplementedError, match="speculative"):
        selective_state_update(torch.zeros(1, H, P, N), inp["x"], inp["dt"], par["A"], inp["B"], inp["C"],
                               out=torch.empty(1, H, P), intermediate_states_buffer=torch.zeros(1))


DIM, WIDTH = 24, 4


@pytest.mark.parametrize("with_initial_state", [False, True])
def test_causal_conv1d_fn_and_update_match_transformers(with_initial_state):
    """Mamba-2's conv signature (SGLang mamba.py) on packed sequences, then one decode step."""
    gen = torch.Generator().manual_seed(11)
    lengths = [5, 1, 19]
    x = torch.randn(sum(lengths), DIM, generator=gen)
    weight, bias = torch.randn(DIM, WIDTH, generator=gen), torch.randn(DIM, generator=gen)
    pool = torch.randn(5, DIM, WIDTH - 1, generator=gen)
    history = pool.clone()
    slots = torch.tensor([2, 0, 4], dtype=torch.int32)
    has_init = torch.tensor([with_initial_state] * 3)
    out = causal_conv1d_fn(x.t(), weight, bias, query_start_loc=_cu(lengths), cache_indices=slots,
                           has_initial_state=has_init, conv_states=pool, activation="silu", seq_lens_cpu=lengths)
    starts = _cu(lengths).tolist()
    for i, slot in enumerate(slots.tolist()):
        prefix = history[slot] if with_initial_state else torch.zeros(DIM, WIDTH - 1)
        seq = torch.cat([prefix, x[starts[i] : starts[i + 1]].t()], dim=-1)
        ref = hf_causal_conv1d_fn(seq[None], weight, bias, activation="silu")[0, :, WIDTH - 1 :]
        torch.testing.assert_close(out[:, starts[i] : starts[i + 1]], ref, atol=ATOL, rtol=ATOL)
        torch.testing.assert_close(pool[slot], seq[:, -(WIDTH - 1) :])

    step = torch.randn(3, DIM, generator=gen)
    after_prefill = pool.clone()
    y = causal_conv1d_update(step, pool, weight, bias, activation="silu", conv_state_indices=slots)
    for i, slot in enumerate(slots.tolist()):
        seq = torch.cat([after_prefill[slot], step[i][:, None]], dim=-1)
        ref = hf_causal_conv1d_fn(seq[None], weight, bias, activation="silu")[0, :, -1]
        torch.testing.assert_close(y[i], ref, atol=ATOL, rtol=ATOL)
        torch.testing.assert_close(pool[slot], seq[:, 1:])


def test_conv_update_refuses_speculative_arguments():
    with pytest.raises(NotImplementedError, match="speculative"):
        causal_conv1d_update(torch.zeros(1, DIM), torch.zeros(1, DIM, WIDTH - 1), torch.zeros(DIM, WIDTH),
                             intermediate_conv_window=torch.zeros(1))
