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

Timings are not taken here; callers time `assemble` against `full_prefill`.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch

from sglang_ext.linearkv import ops
from sglang_ext.linearkv.initializers import LayerChunks, Seed, StateRule, get_state_rule
from sglang_ext.linearkv.selectors import Selector
from sglang_ext.linearkv.serving import ChunkPlan
from sglang_ext.linearkv.store import ChunkEntry, ChunkReferenceError, ChunkStore, LinearLayerState, chunk_id

ARCHS = {"qwen3_next": "gdn", "nemotron_h": "mamba2"}


@dataclass(frozen=True)
class RopeSpec:
    rotary_dim: int
    base: float
    neox: bool = True


@dataclass(frozen=True)
class ModelLayout:
    """Which layers are what, and how keys are rotated (None: NoPE)."""

    arch: str                         # transformers model_type
    kind: str                         # linear layer kind: gdn | mamba2
    model_id: str
    dtype: torch.dtype
    attention_layers: tuple[int, ...]
    linear_layers: tuple[int, ...]
    rope: RopeSpec | None

    @property
    def check_layer(self) -> int:
        """CacheBlend's check layer on a hybrid: the first full-attention layer."""
        return self.attention_layers[0]


def model_layout(model, model_id: str | None = None) -> ModelLayout:
    """Layout of a transformers Qwen3-Next or Nemotron-H causal LM; refuses others by name."""
    cfg = model.config
    arch = cfg.model_type
    if arch not in ARCHS:
        raise ValueError(f"LinearKV reference: unsupported model_type {arch!r}; supported: {sorted(ARCHS)}")
    types = list(cfg.layer_types)
    rope = None
    if arch == "qwen3_next":
        params = dict(getattr(cfg, "rope_parameters", None) or {})
        rope_type = params.get("rope_type", "default")
        if rope_type != "default":
            raise ValueError(f"LinearKV reference: rope_type {rope_type!r} (scaled RoPE) is not supported")
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        factor = params.get("partial_rotary_factor", getattr(cfg, "partial_rotary_factor", 1.0))
        rope = RopeSpec(int(head_dim * factor), float(params.get("rope_theta", getattr(cfg, "rope_theta", 10000.0))))
    dtype = next(model.parameters()).dtype
    ident = model_id or f"{arch}:{getattr(cfg, '_name_or_path', '') or 'unnamed'}:{dtype}"
    return ModelLayout(
        arch=arch, kind=ARCHS[arch], model_id=ident, dtype=dtype,
        attention_layers=tuple(i for i, t in enumerate(types) if t == "full_attention"),
        linear_layers=tuple(i for i, t in enumerate(types) if t == "linear_attention"),
        rope=rope,
    )


def new_store(layout: ModelLayout) -> ChunkStore:
    return ChunkStore(layout.model_id, layout.dtype)


# ---------------------------------------------------------------------------------------------
# model plumbing


def _layers(model):
    return model.model.layers


def _mixer(model, layout: ModelLayout, i: int):
    layer = _layers(model)[i]
    return layer.linear_attn if layout.arch == "qwen3_next" else layer.mixer


def _final_norm(model, layout: ModelLayout):
    return model.model.norm if layout.arch == "qwen3_next" else model.model.norm_f


def _new_cache(model):
    from transformers import DynamicCache

    return DynamicCache(config=model.config)


def state_shape(model, layout: ModelLayout, i: int) -> tuple[int, int, int]:
    """Recurrent state shape of linear layer i without batch: GDN [H, dk, dv], Mamba-2 [H, p, n]."""
    m = _mixer(model, layout, i)
    if layout.kind == "gdn":
        return (m.num_v_heads, m.head_k_dim, m.head_v_dim)
    return (m.num_heads, m.head_dim, m.ssm_state_size)


def _seed_linear(cache, i: int, state: torch.Tensor, conv: torch.Tensor) -> None:
    """Make layer i of `cache` continue from (state [1, ...], conv [1, conv_dim, kernel])."""
    layer = cache.layers[i]
    layer.lazy_initialization(conv_states=conv, recurrent_states=state, conv_kernel_size=conv.shape[-1])
    layer.conv_states[0].copy_(conv)
    layer.recurrent_states[0].copy_(state)
    layer.has_previous_state[0] = True


def cache_from(model, layout: ModelLayout, kv: dict, linear: dict):
    """A DynamicCache holding `kv[layer] = (K, V)` ([1, Hkv, T, D]) and `linear[layer] = Seed`
    (batch dim included), ready for decoding at position T."""
    cache = _new_cache(model)
    for i, (k, v) in kv.items():
        cache.layers[i].update(k, v)
    for i, seed in linear.items():
        _seed_linear(cache, i, seed.state, seed.conv)
    return cache


def _call_layer(model, layout, i, h, pos, cache, mask):
    layer = _layers(model)[i]
    position_ids = pos[None] if pos.dim() == 1 else pos
    if layout.arch == "qwen3_next":
        pe = model.model.rotary_emb(h, position_ids)
        return layer(h, position_embeddings=pe, attention_mask=mask, position_ids=position_ids,
                     past_key_values=cache)
    return layer(h, past_key_values=cache, attention_mask=mask, position_ids=position_ids)


@contextlib.contextmanager
def _span_chunk_size(model, layout: ModelLayout, i: int, length: int):
    """Run linear layer i's chunked scan with a chunk no longer than needed for a `length`-token
    span: transformers' torch kernels pad every call to a multiple of the chunk size (GDN 64,
    Mamba-2 128), which would make a 16-token span cost a whole chunk. The result is the same
    recurrence (chunking is exact); only the padding goes."""
    size = 16
    while size < length:
        size *= 2
    if layout.kind == "mamba2":
        mixer = _mixer(model, layout, i)
        original = mixer.chunk_size
        mixer.chunk_size = min(original, size)
        try:
            yield
        finally:
            mixer.chunk_size = original
    else:
        import functools

        from transformers.models.qwen3_next import modeling_qwen3_next as mod

        original = mod.torch_chunk_gated_delta_rule
        mod.torch_chunk_gated_delta_rule = functools.partial(original, chunk_size=min(64, size))
        try:
            yield
        finally:
            mod.torch_chunk_gated_delta_rule = original


# ---------------------------------------------------------------------------------------------
# capture of transitions


def gdn_transition_by_state(chunk_fn, query, key, g, beta, **flags) -> torch.Tensor:
    """The chunk's GDN transition [B, H, dk, dk] (fp32) by the "v = 0, initial state = I" trick:
    `chunk_fn` (a chunked gated-delta-rule with transformers' / FLA's signature, given the same
    q, k [B, T, H, dk], g, beta [B, T, H] and flags as the real call) run on zero values from the
    identity state ends in exactly prod_t exp(g_t)(I - beta_t k_t k_t^T) (latest on the left)."""
    b, _, hv, dk = key.shape
    eye = torch.eye(dk, dtype=torch.float32, device=key.device).expand(b, hv, dk, dk).contiguous()
    zeros = torch.zeros(*key.shape[:3], dk, dtype=key.dtype, device=key.device)
    _, trans = chunk_fn(query, key, zeros, g, beta, initial_state=eye, output_final_state=True, **flags)
    return trans.float()


@contextlib.contextmanager
def capture_transitions(model, layout: ModelLayout) -> Iterator[dict[int, torch.Tensor]]:
    """While active, every multi-token linear layer forward records its chunk's
    transition into the yielded dict (layer -> GDN [H, dk, dk] / Mamba-2 [H], fp32; batch 1)."""
    out: dict[int, torch.Tensor] = {}
    current: list[int] = []
    handles = []
    if layout.kind == "gdn":
        from transformers.models.qwen3_next import modeling_qwen3_next as mod

        original = mod.torch_chunk_gated_delta_rule

        def wrapped(query, key, value, g, beta, *args, initial_state=None, **kwargs):
            result = original(query, key, value, g, beta, *args, initial_state=initial_state, **kwargs)
            if current:                 # the transition does not depend on the initial state
                flags = {k: v for k, v in kwargs.items() if k in ("use_qk_l2norm_in_kernel", "chunk_size")}
                out[current[-1]] = gdn_transition_by_state(original, query, key, g, beta, **flags)[0]
            return result

        for i in layout.linear_layers:
            handles.append(_mixer(model, layout, i).register_forward_pre_hook(
                lambda m, a, i=i: current.append(i)))
        mod.torch_chunk_gated_delta_rule = wrapped
        try:
            yield out
        finally:
            mod.torch_chunk_gated_delta_rule = original
            for h in handles:
                h.remove()
    else:
        for i in layout.linear_layers:
            mixer = _mixer(model, layout, i)

            def hook(m, args, output, mixer=mixer, i=i):
                dt = output[0, :, -mixer.num_heads:].float() + mixer.dt_bias.float()
                lo, hi = mixer.time_step_limit
                dt = torch.nn.functional.softplus(dt).clamp(min=lo, max=hi)
                out[i] = ops.mamba2_chunk_decay(dt, -torch.exp(mixer.A_log.float()))

            handles.append(mixer.in_proj.register_forward_hook(hook))
        try:
            yield out
        finally:
            for h in handles:
                h.remove()


# ---------------------------------------------------------------------------------------------
# registration


@torch.no_grad()
def register(model, layout: ModelLayout, token_ids: Sequence[int], store: ChunkStore | None = None,
             transitions: bool = True) -> ChunkEntry:
    """Prefill `token_ids` alone (positions 0..n-1, zero state) and cache what LinearKV needs."""
    ids = [int(t) for t in token_ids]
    if not ids:
        raise ValueError("register: empty chunk")
    cache = _new_cache(model)
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
            cache = _new_cache(model)
            if conv_seeds and i in conv_seeds:
                _seed_linear(cache, i, torch.zeros(1, *state_shape(model, layout, i)), conv_seeds[i][None])
            _mixer(model, layout, i)(x, cache_params=cache)
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
    cache = _new_cache(model)
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
        pc = _new_cache(model)
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
    n_layers = len(_layers(model))
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
                _call_layer(model, layout, i, h, pos, shim, _mask(pos, n, dtype))
                fk, fv = shim.fresh
                dev = torch.zeros(n)
                dev[pos] = ((fk - cached_k[:, :, pos]).float() ** 2).sum((0, 1, 3)) + \
                    ((fv - cached_v[:, :, pos]).float() ** 2).sum((0, 1, 3))
                keep = selector.select(dev, spans, suffix_span)
                row_of = {q: r for r, q in enumerate(recomputed)}
                rows = torch.tensor([row_of[q] for q in keep])
                h, recomputed, pos = h[:, rows], keep, torch.tensor(keep)
            shim = _ScatterKV(k, v, pos)
            h = _call_layer(model, layout, i, h, pos, shim, _mask(pos, n, dtype))
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
                cache = _new_cache(model)
                _seed_linear(cache, i, torch.stack([sd.state for sd in seeds]), torch.stack([sd.conv for sd in seeds]))
                with _span_chunk_size(model, layout, i, rows.shape[1]):
                    out = _call_layer(model, layout, i, h[0, rows], torch.tensor([g for g, _ in batch]), cache, None)
                new_h[0, rows] = out
                for b, ((group, _), seed) in enumerate(zip(batch, seeds)):
                    if group[-1] == n - 1:      # the span that ends the prompt: decoding continues from it
                        question_seeds[i] = seed
                        final_linear[i] = Seed(cache.layers[i].recurrent_states[0][b:b + 1].clone(),
                                               cache.layers[i].conv_states[0][b:b + 1].clone())
            h = new_h
        else:                                    # MLP / MoE blocks (Nemotron-H): per token
            h = _call_layer(model, layout, i, h, pos, None, None)

    row_of = {q: r for r, q in enumerate(recomputed)}
    q_rows = torch.tensor([row_of[q] for q in range(*suffix_span)])
    hq = _final_norm(model, layout)(h[:, q_rows])
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
