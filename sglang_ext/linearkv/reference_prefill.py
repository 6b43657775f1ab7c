"""LinearKV's reference path: chunk registration (a standalone prefill from zero state and what it
leaves: KV, end states, conv windows, transitions), the plain full prefill it is measured against,
and greedy decoding from a cache. No SGLang."""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from sglang_ext.linearkv.initializers import Seed
from sglang_ext.linearkv.reference_model import (
    ModelLayout,
    capture_transitions,
    mixer_of,
    new_cache,
    seed_linear,
    state_shape,
)
from sglang_ext.linearkv.store import ChunkEntry, ChunkStore, LinearLayerState, chunk_id

# ---------------------------------------------------------------------------------------------
# registration


@torch.no_grad()
def register(model, layout: ModelLayout, token_ids: Sequence[int], store: ChunkStore | None = None,
             transitions: bool = True) -> ChunkEntry:
    """Prefill `token_ids` alone (positions 0..n-1, zero state) and cache what LinearKV needs."""
    ids = [int(t) for t in token_ids]
    if not ids:
        raise ValueError("register: empty chunk")
    cache = new_cache(model)
    with capture_transitions(model, layout) if transitions else contextlib.nullcontext({}) as trans:
        model(torch.tensor([ids]), position_ids=torch.arange(len(ids))[None], past_key_values=cache, use_cache=True)
    kv = {i: (cache.layers[i].keys[0].clone(), cache.layers[i].values[0].clone()) for i in layout.attention_layers}
    linear = {i: LinearLayerState(cache.layers[i].recurrent_states[0][0].clone(),
                                  cache.layers[i].conv_states[0][0].clone(), trans.get(i))
              for i in layout.linear_layers}
    entry = ChunkEntry(chunk_id(layout.model_id, ids), layout.model_id, tuple(ids), layout.dtype, kv, linear)
    if store is not None:
        store.add(entry)
    return entry


@torch.no_grad()
def mixer_states(model, layout: ModelLayout, inputs: dict[int, torch.Tensor],
                 conv_seeds: dict[int, torch.Tensor] | None = None) -> dict[int, LinearLayerState]:
    """Run each linear layer's mixer alone on `inputs[layer]` ([1, n, hidden], the mixer's own
    input) from zero recurrent state and the conv window `conv_seeds[layer]` ([conv_dim, kernel];
    zeros when absent); its end state, conv window and transition. Used to check composition
    against a sequential prefill with the same layer inputs."""
    out = {}
    with capture_transitions(model, layout) as trans:
        for i, x in inputs.items():
            cache = new_cache(model)
            if conv_seeds and i in conv_seeds:
                seed_linear(cache, i, torch.zeros(1, *state_shape(model, layout, i)), conv_seeds[i][None])
            mixer_of(model, layout, i)(x, cache_params=cache)
            out[i] = LinearLayerState(cache.layers[i].recurrent_states[0][0].clone(),
                                      cache.layers[i].conv_states[0][0].clone(), trans[i])
    return out


# ---------------------------------------------------------------------------------------------
# full prefill (the baseline) and decoding


@dataclass
class Prefill:
    logits: torch.Tensor          # [len(suffix), vocab] logits at the question's positions
    cache: object                 # DynamicCache after the whole prompt
    context_states: dict          # layer -> Seed at the end of the context (before the question)


@torch.no_grad()
def full_prefill(model, layout: ModelLayout, context_ids: Sequence[int], suffix_ids: Sequence[int]) -> Prefill:
    """Plain prefill of context then suffix in one cache (exact continuation); also snapshots
    the linear states at the context's end (for the composition diagnostic)."""
    cache = new_cache(model)
    n = len(context_ids)
    model(torch.tensor([list(context_ids)]), position_ids=torch.arange(n)[None], past_key_values=cache, use_cache=True)
    states = {i: Seed(cache.layers[i].recurrent_states[0][0].clone(), cache.layers[i].conv_states[0][0].clone())
              for i in layout.linear_layers}
    out = model(torch.tensor([list(suffix_ids)]), position_ids=(n + torch.arange(len(suffix_ids)))[None],
                past_key_values=cache, use_cache=True)
    return Prefill(out.logits[0].float(), cache, states)


@torch.no_grad()
def greedy(model, cache, first_logits: torch.Tensor, position: int, max_new_tokens: int,
           forced: Sequence[int] | None = None, stop_ids: Sequence[int] = ()) -> tuple[list[int], list[float]]:
    """Greedy decode from `cache` (next position `position`), starting with `first_logits`.
    With `forced`, feed those tokens instead and return their logprobs (teacher forcing).
    Mutates `cache`."""
    out, lps = [], []
    logp = torch.log_softmax(first_logits.float(), -1)
    steps = len(forced) if forced is not None else max_new_tokens
    for step in range(steps):
        tok = int(forced[step]) if forced is not None else int(logp.argmax())
        out.append(tok)
        lps.append(float(logp[tok]))
        if tok in stop_ids or step == steps - 1:
            break
        res = model(torch.tensor([[tok]]), position_ids=torch.tensor([[position + step]]), past_key_values=cache,
                    use_cache=True)
        logp = torch.log_softmax(res.logits[0, -1].float(), -1)
    return out, lps

