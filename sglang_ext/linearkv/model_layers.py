"""SGLang adapter: what LinearKV reads of a served model (its attention layers' rotary embeddings,
whether its linear layers' chunk transitions are all scalar decays) and the copy of chunk KV to a new offset (keys
re-rotated: RoPE composes, R(c_j) R(p) = R(c_j + p); NoPE keys are copied as they are)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from sglang_ext.linearkv.ops import rerotate_keys


class KeyRelocator:
    """Copies chunk KV between pool slots, re-rotating keys by the chunk's new offset. `translate`:
    how the tree's and the allocator's slot ids become pool indices (a unified pool's
    `translate_kv_loc`, virtual -> physical, read at each copy); None where they are the same."""

    def __init__(self, kv_pool: Any, layers: list[tuple[int, Any]],
                 translate: Callable[[torch.Tensor], torch.Tensor] | None = None):
        self.kv_pool = kv_pool
        self.layers = layers   # (layer id, rotary module or None for NoPE)
        self.translate = translate

    def copy(self, src: torch.Tensor, dst: torch.Tensor, delta: int) -> None:
        """Copy the KV at slots `src` to slots `dst` (slot ids as the tree and the allocator hand
        them out), keys re-rotated by `delta`. May mutate: the pool at `dst`."""
        if self.translate is not None:
            src, dst = self.translate(src), self.translate(dst)
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


def scalar_decays_only(model: Any) -> bool:
    """Whether an SGLang model has linear layers and every one is of a kind whose chunk transition
    is a scalar decay per head (`LinearKind.scalar_decay`: Mamba-2, not GDN), so chunks compose."""
    from sglang_ext.tail_replay import linear_kinds_in

    kinds = linear_kinds_in(model)
    return bool(kinds) and all(kind.scalar_decay for kind in kinds)


def check_rotary(layers: list[tuple[int, Any]]) -> None:
    """Only plain RoPE (any rotary_dim, NeoX or GPT-J pairing) and NoPE can be re-rotated exactly."""
    from sglang.srt.layers.rotary_embedding.base import RotaryEmbedding

    for layer_id, rotary in layers:
        if rotary is not None and type(rotary) is not RotaryEmbedding:
            raise ValueError(f"--radix-cache-backend linearkv: attention layer {layer_id} uses "
                             f"{type(rotary).__name__} (scaled or multimodal RoPE); only plain RoPE and "
                             "NoPE keys can be moved to a new offset")

