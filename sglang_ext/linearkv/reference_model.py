"""LinearKV's reference path, the transformers side: a model's layout (which layers are attention
and which linear, its RoPE), the `DynamicCache` plumbing (seeding a linear layer's state, a cache
from cached chunk KV and states, one decoder layer's call), and the capture of chunk transitions
(GDN: the "v = 0, initial state = I" trick; Mamba-2: the decays from `in_proj`'s dt). No SGLang."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from sglang_ext.linearkv import ops
from sglang_ext.linearkv.store import ChunkStore

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


def decoder_layers(model):
    return model.model.layers


def mixer_of(model, layout: ModelLayout, i: int):
    layer = decoder_layers(model)[i]
    return layer.linear_attn if layout.arch == "qwen3_next" else layer.mixer


def final_norm(model, layout: ModelLayout):
    return model.model.norm if layout.arch == "qwen3_next" else model.model.norm_f


def new_cache(model):
    from transformers import DynamicCache

    return DynamicCache(config=model.config)


def state_shape(model, layout: ModelLayout, i: int) -> tuple[int, int, int]:
    """Recurrent state shape of linear layer i without batch: GDN [H, dk, dv], Mamba-2 [H, p, n]."""
    m = mixer_of(model, layout, i)
    if layout.kind == "gdn":
        return (m.num_v_heads, m.head_k_dim, m.head_v_dim)
    return (m.num_heads, m.head_dim, m.ssm_state_size)


def seed_linear(cache, i: int, state: torch.Tensor, conv: torch.Tensor) -> None:
    """Make layer i of `cache` continue from (state [1, ...], conv [1, conv_dim, kernel])."""
    layer = cache.layers[i]
    layer.lazy_initialization(conv_states=conv, recurrent_states=state, conv_kernel_size=conv.shape[-1])
    layer.conv_states[0].copy_(conv)
    layer.recurrent_states[0].copy_(state)
    layer.has_previous_state[0] = True


def cache_from(model, layout: ModelLayout, kv: dict, linear: dict):
    """A DynamicCache holding `kv[layer] = (K, V)` ([1, Hkv, T, D]) and `linear[layer] = Seed`
    (batch dim included), ready for decoding at position T."""
    cache = new_cache(model)
    for i, (k, v) in kv.items():
        cache.layers[i].update(k, v)
    for i, seed in linear.items():
        seed_linear(cache, i, seed.state, seed.conv)
    return cache


def call_layer(model, layout, i, h, pos, cache, mask):
    layer = decoder_layers(model)[i]
    position_ids = pos[None] if pos.dim() == 1 else pos
    if layout.arch == "qwen3_next":
        pe = model.model.rotary_emb(h, position_ids)
        return layer(h, position_embeddings=pe, attention_mask=mask, position_ids=position_ids,
                     past_key_values=cache)
    return layer(h, past_key_values=cache, attention_mask=mask, position_ids=position_ids)


@contextlib.contextmanager
def span_chunk_size(model, layout: ModelLayout, i: int, length: int):
    """Run linear layer i's chunked scan with a chunk no longer than needed for a `length`-token
    span: transformers' torch kernels pad every call to a multiple of the chunk size (GDN 64,
    Mamba-2 128), which would make a 16-token span cost a whole chunk. The result is the same
    recurrence (chunking is exact); only the padding goes."""
    size = 16
    while size < length:
        size *= 2
    if layout.kind == "mamba2":
        mixer = mixer_of(model, layout, i)
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
            handles.append(mixer_of(model, layout, i).register_forward_pre_hook(
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
            mixer = mixer_of(model, layout, i)

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


