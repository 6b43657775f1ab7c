"""Re-rotation of RoPE'd keys to shifted positions, in pure torch.

RoPE rotates each 2-D pair i of a key at position p by the angle p * theta_i, theta_i =
base^(-2i / rotary_dim). Rotations compose, R(p + delta) = R(delta) R(p), so a key cached at
position p moves to p + delta by one more rotation by delta; values are unchanged.

Conventions (transformers' `apply_rotary_pos_emb` / SGLang's `RotaryEmbedding`):
- keys [T, H, D]; only the first `rotary_dim` dims rotate, the rest pass through (partial rotary:
  Qwen3-Next has partial_rotary_factor 0.25, rotary_dim = 64 of head_dim 256);
- `neox=True` (rotate_half, Qwen / Llama / transformers): pair i is (x[i], x[i + rotary_dim/2]);
  `neox=False` (GPT-J): pair i is (x[2i], x[2i+1]);
- plain cos / sin (no YaRN mscale / attention_scaling: the cached keys already carry it once);
- math in fp32, result in k's dtype; delta may be negative.

SGLang 0.5.23's own `RotaryEmbedding.forward_native(positions=delta, query, key)`
(`srt/layers/rotary_embedding/base.py`) gives the same re-rotation on CPU for 0 <= delta <
max_position_embeddings (it indexes its cos_sin_cache by position, which SGLang keeps in the model
dtype on CPU, fp32 on CUDA); `tests/kernels/test_rope_sglang.py` checks the two agree. This twin
takes no SGLang import so that it runs anywhere and handles any delta.
"""

from __future__ import annotations

import torch


def rope_inv_freq(rotary_dim: int, base: float, device: torch.device | str | None = None) -> torch.Tensor:
    """theta [rotary_dim / 2] fp32, computed as transformers' default RoPE init does."""
    if rotary_dim <= 0 or rotary_dim % 2:
        raise ValueError(f"rotary_dim must be a positive even number, got {rotary_dim}")
    return 1.0 / (base ** (torch.arange(0, rotary_dim, 2, dtype=torch.float32, device=device) / rotary_dim))


def _deltas(delta: int | torch.Tensor, num_tokens: int, device: torch.device) -> torch.Tensor:
    """delta (int, 0-d or [T] tensor) -> [T] fp32."""
    d = torch.as_tensor(delta, device=device)
    if d.dim() == 0:
        d = d.expand(num_tokens)
    if d.shape != (num_tokens,):
        raise ValueError(f"delta must be an int or a [T] = [{num_tokens}] tensor, got shape {tuple(d.shape)}")
    return d.to(torch.float32)


def rerotate_keys_ref(k: torch.Tensor, delta: int | torch.Tensor, rotary_dim: int, base: float,
                      neox: bool = True) -> torch.Tensor:
    """k [T, H, D] rotated at positions p -> the same keys rotated at p + delta ([T, H, D], k's dtype).

    delta: an int (every token moves by it) or a [T] integer tensor (per token).
    """
    T, _, D = k.shape
    if rotary_dim > D:
        raise ValueError(f"rotary_dim {rotary_dim} exceeds head dim {D}")
    inv_freq = rope_inv_freq(rotary_dim, base, device=k.device)
    angle = _deltas(delta, T, k.device)[:, None] * inv_freq[None, :]     # [T, rd/2]
    cos, sin = angle.cos()[:, None, :], angle.sin()[:, None, :]          # [T, 1, rd/2]
    rot = k[..., :rotary_dim].float()
    if neox:
        x1, x2 = rot[..., : rotary_dim // 2], rot[..., rotary_dim // 2:]
        out = torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)
    else:
        x1, x2 = rot[..., 0::2], rot[..., 1::2]
        out = torch.stack([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).flatten(-2)
    return torch.cat([out.to(k.dtype), k[..., rotary_dim:]], dim=-1)
