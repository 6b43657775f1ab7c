"""Gated DeltaNet (GDN) prefill and decode in pure torch, SGLang's layouts and semantics.

Targets (SGLang 0.5.23, called via `sgl_kernel/mamba.py` and
`srt/layers/attention/linear/{gdn_backend.py,kernels/gdn_triton.py}`):
`chunk_gated_delta_rule_cpu`, `fused_gdn_gating_cpu`,
`fused_sigmoid_gating_delta_rule_update_cpu`.

Recurrence per value head, state S [V, K]:  S <- exp(g_t) S;  S <- S + beta_t (v_t - S k_t) k_t^T;
o_t = S q_t / sqrt(K). q, k are L2-normalised first when `use_qk_l2norm_in_kernel`; key
heads are shared by HV/HK value heads (GQA-style `repeat_interleave`).
The prefill uses the chunked (WY) form with chunks of `CHUNK` tokens and also returns the
state at every chunk start (`h`, FLA's convention), which SGLang's `extra_buffer` strategy reads.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

CHUNK = 64


def _l2norm(x: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + 1e-6)


def _expand_heads(x: torch.Tensor, num_v_heads: int) -> torch.Tensor:
    """[T, HK, D] -> [T, HV, D]."""
    return x.repeat_interleave(num_v_heads // x.shape[1], dim=1)


def _prep_qk(q: torch.Tensor, k: torch.Tensor, num_v_heads: int, l2norm: bool):
    q, k = q.float(), k.float()
    if l2norm:
        q, k = _l2norm(q), _l2norm(k)
    return _expand_heads(q, num_v_heads), _expand_heads(k, num_v_heads)


def gdn_chunk_sequence(q, k, v, g, beta, state):
    """One sequence. q, k [T, H, K]; v [T, H, V]; g, beta [T, H]; state [H, V, K] (fp32).

    Returns (o [T, H, V], final state [H, V, K], chunk-start states [NT, H, V, K]).
    """
    T = q.shape[0]
    scale = q.shape[-1] ** -0.5
    outs, starts = [], []
    for c0 in range(0, T, CHUNK):
        sl = slice(c0, min(c0 + CHUNK, T))
        starts.append(state)
        o, state = _gdn_one_chunk(q[sl] * scale, k[sl], v[sl], g[sl], beta[sl], state)
        outs.append(o)
    h = torch.stack(starts) if starts else state.new_zeros((0, *state.shape))
    o = torch.cat(outs) if outs else v.new_zeros(v.shape)
    return o, state, h


def _gdn_one_chunk(q, k, v, g, beta, state):
    """q, k [C, H, K]; v [C, H, V]; g, beta [C, H]; state [H, V, K] -> (o [C, H, V], state)."""
    q, k, v = (x.transpose(0, 1) for x in (q, k, v))         # [H, C, *]
    g_cum = g.transpose(0, 1).cumsum(-1)                     # [H, C]
    b = beta.transpose(0, 1).unsqueeze(-1)                   # [H, C, 1]
    C = q.shape[1]
    causal = torch.ones(C, C, dtype=torch.bool).tril()
    decay = (g_cum.unsqueeze(-1) - g_cum.unsqueeze(-2)).masked_fill(~causal, float("-inf")).exp()
    # WY form: T = (I + strict_lower(beta K K^T * decay))^-1 ; u = T (beta V - beta exp(G) K S^T)
    kk = (b * k) @ k.transpose(-1, -2) * decay
    eye = torch.eye(C, dtype=q.dtype)
    lhs = eye + kk.tril(-1)
    w = torch.linalg.solve_triangular(lhs, b * k * g_cum.exp().unsqueeze(-1), upper=False)
    u = torch.linalg.solve_triangular(lhs, b * v, upper=False)
    v_new = u - w @ state.transpose(-1, -2)                  # [H, C, V]
    attn = (q @ k.transpose(-1, -2)) * decay                 # includes the diagonal
    o = (q * g_cum.exp().unsqueeze(-1)) @ state.transpose(-1, -2) + attn @ v_new
    g_last = g_cum[:, -1:]
    k_decayed = k * (g_last - g_cum).exp().unsqueeze(-1)     # [H, C, K]
    state = state * g_last.exp().unsqueeze(-1) + v_new.transpose(-1, -2) @ k_decayed
    return o.transpose(0, 1), state


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
        o, final, h = gdn_chunk_sequence(qi, ki, v[0, sl].float(), g[0, sl].float(),
                                         beta[0, sl].float(), initial_state[slot].float())
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
    g = -A_log.float().exp() * F.softplus(a.float() + dt_bias.float(), beta=beta, threshold=threshold)
    return g.unsqueeze(0), torch.sigmoid(b.float()).unsqueeze(0)


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
    state = initial_state_source[slots].float()                          # [B, HV, V, K]
    state = state * g[0].exp()[..., None, None]
    pred = (state @ ke.unsqueeze(-1)).squeeze(-1)                        # [B, HV, V]
    delta = (v[0].float() - pred) * beta[0].unsqueeze(-1)
    state = state + delta.unsqueeze(-1) * ke.unsqueeze(-2)
    o = (state @ (qe * qe.shape[-1] ** -0.5).unsqueeze(-1)).squeeze(-1)
    initial_state_source[slots] = state.to(initial_state_source.dtype)
    return o.unsqueeze(0).to(v.dtype)
