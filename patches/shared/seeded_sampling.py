"""Seeded sampling that does not depend on the rest of the batch.

Targets (SGLang 0.5.23) `srt/layers/sampler.py::top_k_top_p_min_p_sampling_from_probs_torch`
(~line 785), which `Sampler._sample_from_probs` calls for the `pytorch` sampling backend (the backend
`--enable-deterministic-inference` forces) whenever ANY request of the batch needs top-k, top-p or
min-p filtering; a greedy request counts (its top-k is 1).

Under `--enable-deterministic-inference` a request with `sampling_seed` draws its token with the
Gumbel-max trick, its noise hashed from (seed, position, column) (`multinomial_with_seed`). When no
request of the batch filters, the columns are vocabulary ids (`sampling_from_probs_torch`); when one
does, this function sorts every row's probabilities and hashes the columns of the SORTED row, so
the same seeded request draws other noise, and mostly another token, because a greedy request
shares its batch (found by the exactness fuzzer's `sampled` path: the same prompt and seed sampled
alone and beside greedy requests differ from the first token).

The replacement, for seeded batches only (without a seed SGLang's function runs unchanged), keys
the noise by vocabulary id in both cases: SGLang's filter runs on the sorted rows as before, the
filtered probabilities are scattered back to vocabulary order, and SGLang's own
`multinomial_with_seed` draws from their logs, as the unfiltered path does from `log(probs)`. A row
with no filter in effect therefore computes exactly what the unfiltered path computes, and a
filtered row picks among its surviving tokens with the same noise. Applied in both modes: the bug
is SGLang's, on GPUs too. (The filtered rows come from SGLang's own function, so its filter
semantics stay its own; the draw it makes on the sorted columns is discarded.)
"""

from __future__ import annotations

import functools

import torch

TARGET = "srt/layers/sampler.py: top_k_top_p_min_p_sampling_from_probs_torch (seeded rows)"


def seeded_filtered_sample(probs: torch.Tensor, top_ks: torch.Tensor, top_ps: torch.Tensor,
                           sampling_seed: torch.Tensor, positions: torch.Tensor,
                           return_filtered_probs: bool = False):
    """SGLang's own filter (its function, asked for the filtered sorted rows), scattered back to
    vocabulary order, then SGLang's own `multinomial_with_seed` on their logs (noise keyed by
    vocabulary id; see the module docstring). Same returns as the original."""
    from sglang.srt.layers import sampler

    original = getattr(sampler.top_k_top_p_min_p_sampling_from_probs_torch, "__wrapped__",
                       sampler.top_k_top_p_min_p_sampling_from_probs_torch)
    _, probs_sort, probs_idx, _ = original(probs, top_ks, top_ps, None, False, sampling_seed, positions,
                                           return_filtered_probs=True)
    filtered = torch.zeros_like(probs).scatter_(1, probs_idx.long(), probs_sort)
    token = sampler.multinomial_with_seed(torch.log(filtered), sampling_seed, positions)   # (n, 1) vocabulary ids
    batch_next_token_ids = token.view(-1).to(torch.int32)
    if return_filtered_probs:
        sampled_index = torch.argmax((probs_idx == token).to(torch.int8), dim=1, keepdim=True)   # its rank
        selected_weight = torch.gather(probs_sort, 1, sampled_index).view(-1)
        return batch_next_token_ids, probs_sort, probs_idx, selected_weight
    return batch_next_token_ids


def _wrap(original):
    @functools.wraps(original)
    def top_k_top_p_min_p_sampling_from_probs_torch(probs, top_ks, top_ps, min_ps, need_min_p_sampling,
                                                     sampling_seed, positions, *, return_filtered_probs=False,
                                                     max_top_k=None):
        if sampling_seed is None or need_min_p_sampling:   # (min-p with a seed: SGLang's own assert)
            return original(probs, top_ks, top_ps, min_ps, need_min_p_sampling, sampling_seed, positions,
                            return_filtered_probs=return_filtered_probs, max_top_k=max_top_k)
        return seeded_filtered_sample(probs, top_ks, top_ps, sampling_seed, positions, return_filtered_probs)

    top_k_top_p_min_p_sampling_from_probs_torch._sglang_ext_patched = True
    return top_k_top_p_min_p_sampling_from_probs_torch


def apply() -> None:
    from sglang.srt.layers import sampler

    if getattr(sampler.top_k_top_p_min_p_sampling_from_probs_torch, "_sglang_ext_patched", False):
        return
    sampler.top_k_top_p_min_p_sampling_from_probs_torch = _wrap(sampler.top_k_top_p_min_p_sampling_from_probs_torch)
