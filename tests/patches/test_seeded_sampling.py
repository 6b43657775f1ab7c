"""Seeded sampling does not depend on the batch (`patches/shared/seeded_sampling.py`): a seeded request
draws the token it draws alone, whether or not another request of its batch filters (greedy is
top-k 1), with SGLang's own functions on both sides."""

from __future__ import annotations

import os

os.environ.setdefault("SGLANG_USE_CPU_ENGINE", "1")

from sglang_ext import patches  # noqa: E402

patches.apply_patches("cpu")  # before any SGLang import (stand-in sgl_kernel)

import torch  # noqa: E402
from sglang.srt.layers import sampler  # noqa: E402

from sglang_ext.patches.shared.seeded_sampling import seeded_filtered_sample  # noqa: E402

VOCAB = 37   # awkward on purpose


def _rows(n: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.softmax(torch.randn(n, VOCAB, generator=gen) * 2, dim=-1)


def _batch_with_a_greedy_row(probs: torch.Tensor, fn):
    """Row 0 seeded and unfiltered; row 1 greedy (top-k 1), as SGLang builds a mixed batch."""
    both = torch.stack([probs[0], probs[1]])
    top_ks = torch.tensor([VOCAB, 1], dtype=torch.int32)
    top_ps = torch.ones(2)
    seeds = torch.tensor([1234, 42], dtype=torch.int64)
    positions = torch.tensor([17, 5])
    return fn(both, top_ks, top_ps, torch.zeros(2), False, seeds, positions)


def test_a_seeded_row_draws_what_it_draws_alone_beside_a_greedy_row():
    original = sampler.top_k_top_p_min_p_sampling_from_probs_torch.__wrapped__
    patched = sampler.top_k_top_p_min_p_sampling_from_probs_torch
    assert getattr(patched, "_sglang_ext_patched", False)
    differs = 0
    for trial in range(40):
        probs = _rows(2, trial)
        alone = sampler.sampling_from_probs_torch(probs[:1], torch.tensor([1234]), torch.tensor([17]))
        ours = _batch_with_a_greedy_row(probs, patched)
        assert ours[0].item() == alone.item(), trial
        assert ours[1].item() == torch.argmax(probs[1]).item()          # the greedy row stays greedy
        differs += int(_batch_with_a_greedy_row(probs, original)[0].item() != alone.item())
    assert differs >= 10, differs   # SGLang's sorted-column noise: another token, most of the time


def test_filtered_rows_sample_among_their_survivors_and_the_mask_capture_agrees():
    probs = _rows(6, 99)
    top_ks = torch.tensor([1, 3, VOCAB, 5, VOCAB, 2], dtype=torch.int32)
    top_ps = torch.tensor([1.0, 1.0, 0.5, 0.9, 1.0, 1.0])
    seeds = torch.arange(6, dtype=torch.int64) * 7919
    positions = torch.arange(6) * 3
    tokens, probs_sort, probs_idx, weight = seeded_filtered_sample(probs, top_ks, top_ps, seeds, positions, True)
    assert torch.equal(tokens, seeded_filtered_sample(probs, top_ks, top_ps, seeds, positions))
    for row in range(6):
        kept = probs_idx[row][probs_sort[row] > 0].tolist()
        assert tokens[row].item() in kept
        assert weight[row].item() == probs[row, tokens[row]].item()
    assert tokens[0].item() == torch.argmax(probs[0]).item()
    # the same row keeps its token whatever its neighbours are
    for row in range(6):
        one = seeded_filtered_sample(probs[row:row + 1], top_ks[row:row + 1], top_ps[row:row + 1],
                                     seeds[row:row + 1], positions[row:row + 1])
        assert one.item() == tokens[row].item()
