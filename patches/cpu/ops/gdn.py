"""GDN prefill and decode with SGLang's op signatures and layouts; the math is `hybrid_kernels.gdn`.

Targets (SGLang 0.5.23, called via `sgl_kernel/mamba.py` and
`srt/layers/attention/linear/{gdn_backend.py,kernels/gdn_triton.py}`):
`chunk_gated_delta_rule_cpu`, `fused_gdn_gating_cpu`,
`fused_sigmoid_gating_delta_rule_update_cpu`.

SGLang's state pool is [slots, HV, V, K] (the transpose of hybrid_kernels' S [H, K, V]); q, k
are L2-normalised here when `use_qk_l2norm_in_kernel`, and key heads are shared by HV/HK value
heads (GQA-style `repeat_interleave`). The prefill returns the state at every 64-token chunk start
(`h`, FLA's convention), which SGLang's `extra_buffer` strategy reads.
"""

from __future__ import annotations

import torch

from hybrid_kernels.gdn import (
    CHUNK,
    expand_heads,
    gdn_chunk_ref,
    gdn_gating_ref,
    gdn_recurrent_step_ref,
    l2norm,
    state_from_sglang,
    state_to_sglang,
)

__all__ = ["CHUNK", "chunk_gated_delta_rule_cpu", "chunk_gated_delta_rule_with_h", "fused_gdn_gating_cpu",
           "fused_sigmoid_gating_delta_rule_update_cpu"]


def _prep_qk(q: torch.Tensor, k: torch.Tensor, num_v_heads: int, use_l2norm: bool):
    q, k = q.float(), k.float()
    if use_l2norm:
        q, k = l2norm(q), l2norm(k)
    return expand_heads(q, num_v_heads), expand_heads(k, num_v_heads)


def chunk_gated_delta_rule_with_h(q, k, v, g, beta, initial_state, cu_seqlens, head_first=False,
                                  use_qk_l2norm_in_kernel=True, initial_state_indices=None, **unused):
    """q, k [1, T, HK, K]; v [1, T, HV, V]; g, beta [1, T, HV]; initial_state: the state pool
    [slots, HV, V, K], updated in place at `initial_state_indices`.

    Returns (o [1, T, HV, V], final states [N, HV, V, K], h [1, sum NT_i, HV, V, K]), the
    contract of SGLang's Triton `chunk_gated_delta_rule` (h: state at each 64-token chunk start).
    """
    if head_first:
        raise NotImplementedError("head_first=True has no CPU fallback")
    num_v_heads = v.shape[2]
    bounds = cu_seqlens.tolist()
    out = torch.empty_like(v)
    finals, hs = [], []
    for i, slot in enumerate(initial_state_indices.tolist()):
        sl = slice(bounds[i], bounds[i + 1])
        qi, ki = _prep_qk(q[0, sl], k[0, sl], num_v_heads, use_qk_l2norm_in_kernel)
        o, final, h = gdn_chunk_ref(qi, ki, v[0, sl], g[0, sl], beta[0, sl],
                                    state_from_sglang(initial_state[slot].float()))
        final, h = state_to_sglang(final), state_to_sglang(h)
        out[0, sl] = o.to(out.dtype)
        initial_state[slot] = final.to(initial_state.dtype)
        finals.append(final)
        hs.append(h)
    h_all = torch.cat(hs).unsqueeze(0).to(v.dtype)
    return out, torch.stack(finals).to(initial_state.dtype), h_all


def chunk_gated_delta_rule_cpu(q, k, v, g, beta, initial_state, output_final_state, cu_seqlens,
                               head_first, use_qk_l2norm_in_kernel, initial_state_indices):
    """The `torch.ops.sgl_kernel` contract: returns (o, final states) only."""
    o, final, _ = chunk_gated_delta_rule_with_h(q, k, v, g, beta, initial_state, cu_seqlens, head_first,
                                                use_qk_l2norm_in_kernel, initial_state_indices)
    return o, final


def fused_gdn_gating_cpu(A_log, a, b, dt_bias, beta=1.0, threshold=20.0):
    """a, b [T, HV] -> (g [1, T, HV], beta [1, T, HV]) in fp32: g = -exp(A_log) softplus(a + dt_bias)."""
    g, b = gdn_gating_ref(A_log, a, b, dt_bias, softplus_beta=beta, threshold=threshold)
    return g.unsqueeze(0), b.unsqueeze(0)


def fused_sigmoid_gating_delta_rule_update_cpu(A_log, dt_bias, q, k, v, a, b, initial_state_source,
                                               initial_state_indices, cu_seqlens,
                                               use_qk_l2norm_in_kernel, softplus_beta=1.0,
                                               softplus_threshold=20.0, is_kda=False, **verify):
    """Decode: one token per sequence. q, k [1, B, HK, K]; v [1, B, HV, V]; a, b [B, HV].

    Updates initial_state_source[initial_state_indices] ([slots, HV, V, K]) in place and
    returns o [1, B, HV, V].
    """
    if is_kda or verify.get("disable_state_update"):
        raise NotImplementedError("KDA / speculative verify have no CPU fallback")
    g, beta = fused_gdn_gating_cpu(A_log, a, b, dt_bias, softplus_beta, softplus_threshold)
    qe, ke = _prep_qk(q[0], k[0], v.shape[2], use_qk_l2norm_in_kernel)   # [B, HV, K]
    slots = initial_state_indices.long()
    state = state_from_sglang(initial_state_source[slots].float())      # [B, HV, K, V]
    o, state = gdn_recurrent_step_ref(state, qe, ke, v[0], g[0], beta[0])
    state = state_to_sglang(state)
    initial_state_source[slots] = state.to(initial_state_source.dtype)
    return o.unsqueeze(0).to(v.dtype)
