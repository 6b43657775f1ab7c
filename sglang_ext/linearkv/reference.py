"""LinearKV over transformers models: the reference execution path (CPU or GPU, no SGLang).

Supports transformers' Qwen3-Next (GDN + gated attention with partial RoPE) and Nemotron-H (Mamba-2
+ NoPE attention). Their `DynamicCache` holds per attention layer `keys/values [B, Hkv, T, D]`
(post-RoPE), per linear layer `conv_states[0] [B, conv_dim, conv_kernel]` (the last conv_kernel conv
inputs) and `recurrent_states[0]` (GDN [B, H, dk, dv], Mamba-2 [B, H, head_dim, d_state]), which is
the `hybrid_kernels` convention as is.

- `register(model, layout, ids)`: prefill the chunk alone at positions 0..n-1 from zero state and
  snapshot KV, end states, conv windows and (optionally) transitions. GDN transitions come from a
  second call of the model's own chunked delta rule with v = 0 and initial state I (its final state
  is exactly prod_t exp(g_t)(I - b_t k_t k_t^T)); Mamba-2 decays from the `in_proj` dt slice.
- `assemble(...)`: a PIC request `P | C_1..C_K | Q` run layer by layer over the recomputed set R
  (selector), attention layers reading the cached chunk KV (keys re-rotated to the chunk's offset)
  with R's fresh KV scattered in, under a causal mask by true position; linear layers run R grouped
  into spans seeded by a state rule. Returns the first-token logits and a `DynamicCache` to decode
  from (`greedy`).

Modules: `reference_model` (layout, cache plumbing, transition capture), `reference_prefill`
(registration, full prefill, greedy decode), this one (assembly), which also serves their names.
Timings are not taken here; callers time `assemble` against `full_prefill`.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from sglang_ext.linearkv import ops
from sglang_ext.linearkv.initializers import LayerChunks, Seed, StateRule, get_state_rule
from sglang_ext.linearkv.reference_model import (
    ARCHS,
    ModelLayout,
    RopeSpec,
    cache_from,
    call_layer,
    capture_transitions,
    decoder_layers,
    final_norm,
    gdn_transition_by_state,
    mixer_of,
    model_layout,
    new_cache,
    new_store,
    seed_linear,
    span_chunk_size,
    state_shape,
)
from sglang_ext.linearkv.reference_prefill import Prefill, full_prefill, greedy, mixer_states, register
from sglang_ext.linearkv.selectors import Selector
from sglang_ext.linearkv.serving import ChunkPlan
from sglang_ext.linearkv.store import ChunkEntry, ChunkReferenceError, ChunkStore, LinearLayerState

#: the names `eval.linearkv` reads by their former private spelling
_new_cache, _mixer = new_cache, mixer_of

__all__ = ["ARCHS", "ModelLayout", "RopeSpec", "cache_from", "call_layer", "capture_transitions", "decoder_layers",
           "final_norm", "gdn_transition_by_state", "mixer_of", "model_layout", "new_cache", "new_store",
           "seed_linear", "span_chunk_size", "state_shape", "Prefill", "full_prefill", "greedy", "mixer_states",
           "register", "LinearLayerState", "Assembled", "relocated_keys", "assemble", "state_diagnostic"]


# ---------------------------------------------------------------------------------------------
# assembly


@dataclass
class Assembled:
    logits: torch.Tensor            # [len(suffix), vocab] at the question's positions
    cache: object                   # DynamicCache over the whole prompt, ready to decode
    recomputed: list[int]           # global positions recomputed (question included)
    chunk_spans: list[tuple[int, int]]
    suffix_span: tuple[int, int]
    question_seeds: dict            # layer -> Seed the question's span started from (diagnostics)


class _ScatterKV:
    """Cache shim for one attention layer: fresh K/V of the recomputed tokens overwrite their
    slots of the full-length K/V, and attention reads the full tensors."""

    def __init__(self, k: torch.Tensor, v: torch.Tensor, pos: torch.Tensor):
        self.k, self.v, self.pos = k, v, pos
        self.fresh: tuple[torch.Tensor, torch.Tensor] | None = None

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        self.fresh = (key_states, value_states)
        self.k[:, :, self.pos] = key_states
        self.v[:, :, self.pos] = value_states
        return self.k, self.v


def _mask(q_pos: torch.Tensor, n: int, dtype) -> torch.Tensor:
    keys = torch.arange(n)
    allowed = keys[None, :] <= q_pos[:, None]
    m = torch.zeros(allowed.shape, dtype=dtype)
    m.masked_fill_(~allowed, torch.finfo(dtype).min)
    return m[None, None]


def _resolve(store: ChunkStore | None, layout: ModelLayout, refs) -> list[ChunkEntry]:
    entries = []
    for ref in refs:
        if store is not None:
            entries.append(store.get(ref))
        elif isinstance(ref, ChunkEntry):
            ChunkStore(layout.model_id, layout.dtype).get(ref)
            entries.append(ref)
        else:
            raise ChunkReferenceError(f"chunk {ref!r}: a chunk id needs a store")
    return entries


def relocated_keys(layout: ModelLayout, k: torch.Tensor, delta: int) -> torch.Tensor:
    """Cached K [Hkv, n, D] (rotated at 0..n-1) moved to delta..delta+n-1 with the model's RoPE."""
    if layout.rope is None or delta == 0:
        return k
    moved = ops.rerotate_keys(k.transpose(0, 1).float(), delta, layout.rope.rotary_dim, layout.rope.base,
                              neox=layout.rope.neox)
    return moved.transpose(0, 1).to(k.dtype)


@torch.no_grad()
def assemble(model, layout: ModelLayout, chunks: Sequence, suffix_ids: Sequence[int], selector: Selector,
             rule: StateRule | str, prefix_ids: Sequence[int] = (), store: ChunkStore | None = None) -> Assembled:
    """Run the PIC request `prefix | chunks | suffix` from cached chunks (see module docstring).

    chunks: chunk ids (resolved in `store`) or ChunkEntry objects. The prefix is prefilled exactly
    (as a radix-cache hit would serve it). Raises ChunkReferenceError for a bad chunk reference."""
    rule = get_state_rule(rule) if isinstance(rule, str) else rule
    entries = _resolve(store, layout, chunks)
    if not entries:
        raise ValueError("assemble: no chunks")
    if not suffix_ids:
        raise ValueError("assemble: empty suffix (the question is always recomputed)")
    if rule.needs_transitions and not all(e.has_transitions for e in entries):
        missing = next(e.chunk_id for e in entries if not e.has_transitions)
        raise ChunkReferenceError(f"chunk {missing}: registered without transitions, needed by rule {rule.name!r}")
    dtype = layout.dtype
    prefix = [int(t) for t in prefix_ids]
    p = len(prefix)

    # layout of the prompt
    spans, c = [], p
    for e in entries:
        spans.append((c, c + len(e)))
        c += len(e)
    suffix_span = (c, c + len(suffix_ids))
    n = suffix_span[1]
    # KV-only rules: the recomputed spans are the server's (`serving.ChunkPlan`), each from zero
    replay_spans: list[list[int]] | None = None
    if rule.replay:
        if selector.kind not in ("none", "epic"):
            raise ValueError(f"state rule {rule.name!r} runs with selectors none and epic-k, not {selector.name!r}")
        plan = ChunkPlan(tuple(spans), "replay", selector.k if selector.kind == "epic" else 0, rule.replay)
        replay_spans = [list(range(a, b)) for a, b in plan.heads] + [list(range(plan.forward_start, n))]
    all_ids = torch.tensor(prefix + [t for e in entries for t in e.token_ids] + [int(t) for t in suffix_ids])

    # the prefix, exactly
    prefix_kv, prefix_seed = {}, {}
    if p:
        pc = new_cache(model)
        model(torch.tensor([prefix]), position_ids=torch.arange(p)[None], past_key_values=pc, use_cache=True)
        prefix_kv = {i: (pc.layers[i].keys, pc.layers[i].values) for i in layout.attention_layers}
        prefix_seed = {i: Seed(pc.layers[i].recurrent_states[0][0], pc.layers[i].conv_states[0][0])
                       for i in layout.linear_layers}

    # full-length K/V per attention layer: prefix exact, chunks relocated, question to be computed
    kv = {}
    for i in layout.attention_layers:
        k0, v0 = entries[0].kv[i]
        hk, d = k0.shape[0], k0.shape[-1]
        k = torch.zeros(1, hk, n, d, dtype=dtype)
        v = torch.zeros(1, hk, n, v0.shape[-1], dtype=dtype)
        if p:
            k[:, :, :p], v[:, :, :p] = prefix_kv[i]
        for e, (s, t) in zip(entries, spans):
            ek, ev = e.kv[i]
            k[0, :, s:t] = relocated_keys(layout, ek, s)
            v[0, :, s:t] = ev
        kv[i] = (k, v)

    layer_chunks = {i: LayerChunks(layout.kind, [e.linear[i] for e in entries], prefix_seed.get(i))
                    for i in layout.linear_layers}

    def spans_of(positions: list[int]) -> list[tuple[list[int], int]]:
        """Group recomputed positions into linear-layer spans: (positions, j) with j the number of
        chunks before the span (the question: K); packed rules: one span."""
        if rule.packed:
            return [(positions, len(entries))]
        if replay_spans is not None:
            return [(g, len(entries)) for g in replay_spans if g]
        groups: dict[int, list[int]] = {}
        for q in positions:
            j = next((jj for jj, (s, t) in enumerate(spans) if s <= q < t), len(entries))
            groups.setdefault(j, []).append(q)
        return [(g, j) for j, g in sorted(groups.items())]

    embed = model.get_input_embeddings()
    n_layers = len(decoder_layers(model))
    question_seeds: dict[int, Seed] = {}
    final_linear: dict[int, Seed] = {}

    if selector.needs_check_layer:
        recomputed = list(range(p, n))          # everything until the check layer
        exact_until = layout.check_layer
    elif replay_spans is not None:
        recomputed = [q for g in replay_spans for q in g]
        exact_until = 0
    else:
        recomputed = selector.plan(spans, suffix_span)
        exact_until = 0
    pos = torch.tensor(recomputed)
    h = embed(all_ids[pos])[None]

    for i in range(n_layers):
        kind = model.config.layer_types[i]
        if kind == "full_attention":
            k, v = kv[i]
            if selector.needs_check_layer and i == layout.check_layer:
                cached_k, cached_v = k.clone(), v.clone()
                shim = _ScatterKV(k.clone(), v.clone(), pos)
                call_layer(model, layout, i, h, pos, shim, _mask(pos, n, dtype))
                fk, fv = shim.fresh
                dev = torch.zeros(n)
                dev[pos] = ((fk - cached_k[:, :, pos]).float() ** 2).sum((0, 1, 3)) + \
                    ((fv - cached_v[:, :, pos]).float() ** 2).sum((0, 1, 3))
                keep = selector.select(dev, spans, suffix_span)
                row_of = {q: r for r, q in enumerate(recomputed)}
                rows = torch.tensor([row_of[q] for q in keep])
                h, recomputed, pos = h[:, rows], keep, torch.tensor(keep)
            shim = _ScatterKV(k, v, pos)
            h = call_layer(model, layout, i, h, pos, shim, _mask(pos, n, dtype))
        elif kind == "linear_attention":
            if i < exact_until:                 # CacheBlend's exact pre-pass: one span from the prefix
                groups = [(recomputed, -1)]
            else:
                groups = spans_of(recomputed)
            new_h = torch.empty_like(h)
            row_of = {q: r for r, q in enumerate(recomputed)}
            by_len: dict[int, list] = {}            # spans of equal length run as one batch
            for group, j in groups:
                by_len.setdefault(len(group), []).append((group, j))
            for batch in by_len.values():
                seeds = [layer_chunks[i].start() if j < 0 else rule.seed(layer_chunks[i], j) for _, j in batch]
                rows = torch.tensor([[row_of[q] for q in group] for group, _ in batch])      # [B, L]
                cache = new_cache(model)
                seed_linear(cache, i, torch.stack([sd.state for sd in seeds]), torch.stack([sd.conv for sd in seeds]))
                with span_chunk_size(model, layout, i, rows.shape[1]):
                    out = call_layer(model, layout, i, h[0, rows], torch.tensor([g for g, _ in batch]), cache, None)
                new_h[0, rows] = out
                for b, ((group, _), seed) in enumerate(zip(batch, seeds)):
                    if group[-1] == n - 1:      # the span that ends the prompt: decoding continues from it
                        question_seeds[i] = seed
                        final_linear[i] = Seed(cache.layers[i].recurrent_states[0][b:b + 1].clone(),
                                               cache.layers[i].conv_states[0][b:b + 1].clone())
            h = new_h
        else:                                    # MLP / MoE blocks (Nemotron-H): per token
            h = call_layer(model, layout, i, h, pos, None, None)

    row_of = {q: r for r, q in enumerate(recomputed)}
    q_rows = torch.tensor([row_of[q] for q in range(*suffix_span)])
    hq = final_norm(model, layout)(h[:, q_rows])
    logits = model.lm_head(hq)[0].float()
    cache = cache_from(model, layout, kv, final_linear)
    return Assembled(logits, cache, recomputed, spans, suffix_span, question_seeds)


def state_diagnostic(exact: torch.Tensor, approx: torch.Tensor) -> tuple[float, float]:
    """(||approx|| / ||exact||, cos(approx, exact)) over the flattened state."""
    a, b = approx.float().flatten(), exact.float().flatten()
    nb = float(b.norm())
    ratio = float(a.norm()) / nb if nb > 0 else math.inf
    cos = float(torch.nn.functional.cosine_similarity(a, b, dim=0))
    return ratio, cos
