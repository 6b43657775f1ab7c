"""SGLang adapter: what LinearKV reads of a served model (its attention layers' rotary embeddings,
whether its linear layers are all Mamba-2) and the copy of chunk KV to a new offset (keys
re-rotated: RoPE composes, R(c_j) R(p) = R(c_j + p); NoPE keys are copied as they are)."""

from __future__ import annotations

from typing import Any

import torch

from sglang_ext.linearkv.ops import rerotate_keys


class KeyRelocator:
    """Copies chunk KV between pool slots, re-rotating keys by the chunk's new offset."""

    def __init__(self, kv_pool: Any, layers: list[tuple[int, Any]]):
        self.kv_pool = kv_pool
        self.layers = layers   # (layer id, rotary module or None for NoPE)

    def copy(self, src: torch.Tensor, dst: torch.Tensor, delta: int) -> None:
        for layer_id, rotary in self.layers:
            k = self.kv_pool.get_key_buffer(layer_id)
            v = self.kv_pool.get_value_buffer(layer_id)
            keys = k[src]
            if rotary is not None and delta:
                keys = rerotate_keys(keys.float(), delta, rotary.rotary_dim, float(rotary.base),
                                     neox=bool(rotary.is_neox_style)).to(k.dtype)
            k[dst] = keys
            v[dst] = v[src]


def attention_layers(model: Any) -> list[tuple[int, Any]]:
    """(layer id, rotary embedding or None) of every full-attention layer of an SGLang model."""
    from sglang.srt.layers.radix_attention import RadixAttention

    out = {}
    for module in model.modules():
        attn = getattr(module, "attn", None)
        if isinstance(attn, RadixAttention):
            out[attn.layer_id] = getattr(module, "rotary_emb", None)
    return sorted(out.items())


def only_mamba2(model: Any) -> bool:
    """Whether every linear layer of an SGLang model is a Mamba-2 mixer (none is GDN)."""
    from sglang.srt.layers.attention.mamba.mamba import MambaMixer2
    from sglang.srt.layers.radix_linear_attention import RadixLinearAttention

    mods = list(model.modules())
    return any(isinstance(m, MambaMixer2) for m in mods) and not any(isinstance(m, RadixLinearAttention) for m in mods)


def check_rotary(layers: list[tuple[int, Any]]) -> None:
    """Only plain RoPE (any rotary_dim, NeoX or GPT-J pairing) and NoPE can be re-rotated exactly."""
    from sglang.srt.layers.rotary_embedding.base import RotaryEmbedding

    for layer_id, rotary in layers:
        if rotary is not None and type(rotary) is not RotaryEmbedding:
            raise ValueError(f"--radix-cache-backend linearkv: attention layer {layer_id} uses "
                             f"{type(rotary).__name__} (scaled or multimodal RoPE); only plain RoPE and "
                             "NoPE keys can be moved to a new offset")

