"""Decode-time state tracking in torch (`patches/cpu/ops/mamba_track.py`) against the contract of
SGLang's Triton kernels: for each batch row i < batch_size with the mask set, copy slot
cache_indices[i] to slot mamba_track_indices[i] (conv and SSM state, every layer); with
check_freed_slots, rows naming slot -1 are skipped. The reference is that loop, written out."""

from __future__ import annotations

import pytest
import torch

from sglang_ext.patches.cpu.ops.mamba_track import track_mamba_states_all_layers, track_mamba_states_if_needed

SLOTS, LAYERS = 10, 3


def _pools(seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    conv = torch.randn(LAYERS, SLOTS, 6, 3, generator=gen)
    ssm = torch.randn(LAYERS, SLOTS, 2, 4, 5, generator=gen)
    return conv, ssm


def _reference(conv, ssm, cache_indices, mask, track_indices, batch_size, check_freed_slots):
    conv, ssm = conv.clone(), ssm.clone()
    for i in range(batch_size):
        src, dst = int(cache_indices[i]), int(track_indices[i])
        if not mask[i] or (check_freed_slots and (src < 0 or dst < 0)):
            continue
        conv[:, dst] = conv[:, src]
        ssm[:, dst] = ssm[:, src]
    return conv, ssm


CASES = {
    # name: (cache_indices, mask, track_indices, batch_size, check_freed_slots)
    "some_rows": ([1, 2, 3, 4], [True, False, True, False], [5, 6, 7, 8], 4, False),
    "no_rows": ([1, 2], [False, False], [5, 6], 2, False),
    "padded_batch": ([1, 2, 3], [True, True, True], [5, 6, 7], 2, False),      # row 2 is padding
    "freed_slots": ([1, -1, 3], [True, True, True], [5, 6, -1], 3, True),
}


@pytest.mark.parametrize("case", CASES)
def test_all_layers_copy_matches_the_per_row_loop(case):
    cache_indices, mask, track_indices, batch_size, check = CASES[case]
    conv, ssm = _pools()
    expected = _reference(conv, ssm, cache_indices, mask, track_indices, batch_size, check)
    track_mamba_states_all_layers(conv, ssm, torch.tensor(cache_indices), torch.tensor(mask),
                                  torch.tensor(track_indices, dtype=torch.int64), batch_size,
                                  check_freed_slots=check)
    torch.testing.assert_close(conv, expected[0], rtol=0, atol=0)
    torch.testing.assert_close(ssm, expected[1], rtol=0, atol=0)


@pytest.mark.parametrize("case", CASES)
def test_one_layer_copy_matches_the_per_row_loop(case):
    cache_indices, mask, track_indices, batch_size, check = CASES[case]
    conv, ssm = _pools(1)
    layer_conv, layer_ssm = conv[1].clone(), ssm[1].clone()
    expected = _reference(layer_conv[None], layer_ssm[None], cache_indices, mask, track_indices, batch_size, check)
    track_mamba_states_if_needed(layer_conv, layer_ssm, torch.tensor(cache_indices, dtype=torch.int32),
                                 torch.tensor(mask), torch.tensor(track_indices), batch_size,
                                 check_freed_slots=check)
    torch.testing.assert_close(layer_conv, expected[0][0], rtol=0, atol=0)
    torch.testing.assert_close(layer_ssm, expected[1][0], rtol=0, atol=0)


def test_a_copy_changes_only_the_destination_slots():
    conv, ssm = _pools(2)
    before_conv, before_ssm = conv.clone(), ssm.clone()
    track_mamba_states_all_layers(conv, ssm, torch.tensor([1, 2]), torch.tensor([True, True]),
                                  torch.tensor([7, 9]), 2)
    changed = [s for s in range(SLOTS) if not torch.equal(conv[:, s], before_conv[:, s])
               or not torch.equal(ssm[:, s], before_ssm[:, s])]
    assert changed == [7, 9]
    assert torch.equal(ssm[:, 7], before_ssm[:, 1]) and torch.equal(conv[:, 9], before_conv[:, 2])
