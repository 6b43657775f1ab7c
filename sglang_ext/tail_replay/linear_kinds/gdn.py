"""Gated DeltaNet (Qwen3-Next, Qwen3.5): the kind's spec (`KIND`).

Replay path (SGLang 0.5.23): `srt/layers/radix_linear_attention.py::RadixLinearAttention.forward`,
the model-layer call every GDN model makes with the gate inputs `a` of the whole packed batch,
before any backend (CPU, Triton, FlashInfer) computes the gating: one seam opens the layer's scope
and reads its gates. Layers of other kinds through the same class (KDA: `lower_bound` set,
per-channel `a`) are not GDN's and are left alone.

Bound hook: g = -exp(A_log) softplus(a + dt_bias) per token and value head (SGLang's
`fused_gdn_gating`); ||S(L) - S_replayed(L)||_F <= exp(sum_tail g) ||S(L - W)||_F per head
(`hybrid_kernels.replay_bound.gdn_replay_bound`). State: SGLang's pool stores the recurrent state
as [HV, dv, dk], the twin (`hybrid_kernels.gdn`) as [HV, dk, dv].
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from sglang_ext.tail_replay.linear_kinds.spec import (
    BoundHook,
    Gates,
    GateSeam,
    LinearKind,
    NaiveTwin,
    Scope,
    StateLayout,
    TwinTail,
    call_arg,
)

if TYPE_CHECKING:
    import torch


def gdn_log_decay(a: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor) -> torch.Tensor:
    """a [n, heads] (the GDN gate input) -> g [n, heads] fp32 = -exp(A_log) softplus(a + dt_bias),
    as SGLang's `fused_gdn_gating` (softplus threshold 20)."""
    import torch.nn.functional as F

    return -A_log.float().exp() * F.softplus(a.float() + dt_bias.float())


def _scope(args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> Scope:
    """`RadixLinearAttention.forward(self, forward_batch, mixed_qkv, a, b, ...)`."""
    layer = args[0]
    return Scope(call_arg(args, kwargs, 1, "forward_batch"), layer.layer_id, layer)


def _gates(args: tuple[Any, ...], kwargs: Mapping[str, Any], layer: Any) -> Gates | None:
    """The gate input `a`, unless the layer is not GDN's (KDA's `lower_bound`, no `A_log`)."""
    if getattr(layer, "lower_bound", None) is not None or layer.A_log is None or layer.dt_bias is None:
        return None
    return Gates(call_arg(args, kwargs, 3, "a"), {"A_log": layer.A_log, "dt_bias": layer.dt_bias})


def _log_decay(rows: torch.Tensor, params: Mapping[str, Any]) -> torch.Tensor:
    return gdn_log_decay(rows, params["A_log"], params["dt_bias"])


def _heads(params: Mapping[str, Any]) -> int:
    return int(params["A_log"].numel())


def _replay(inputs: Mapping[str, torch.Tensor], state: torch.Tensor) -> torch.Tensor:
    """The token-by-token GDN recurrence (`gdn_recurrent_ref`) from `state` [H, dk, dv]."""
    from hybrid_kernels.gdn import gdn_recurrent_ref

    _, end = gdn_recurrent_ref(inputs["q"], inputs["k"], inputs["v"], inputs["g"], inputs["beta"], state)
    return end


def _random_tail(generator: torch.Generator, tokens: int, heads: int) -> TwinTail:
    """Gate inputs a, b as SGLang's layer sees them; g, beta through the twin's gating."""
    import torch

    from hybrid_kernels.gdn import gdn_gating_ref, l2norm

    dk, dv = 8, 6
    a, b = (torch.randn(tokens, heads, generator=generator) for _ in range(2))
    A_log = torch.randn(heads, generator=generator) * 0.5 - 2.0
    dt_bias = torch.randn(heads, generator=generator)
    g, beta = gdn_gating_ref(A_log, a, b, dt_bias)
    k = l2norm(torch.randn(tokens, heads, dk, generator=generator))
    inputs = {"q": torch.zeros_like(k), "k": k, "v": torch.randn(tokens, heads, dv, generator=generator),
              "g": g, "beta": beta}
    return TwinTail(inputs, Gates(a, {"A_log": A_log, "dt_bias": dt_bias}), (heads, dk, dv))


KIND = LinearKind(
    name="gdn",
    layer_classes=("sglang.srt.layers.radix_linear_attention:RadixLinearAttention",),
    seams=(GateSeam("sglang.srt.layers.radix_linear_attention:RadixLinearAttention.forward",
                    scope=_scope, gates=_gates, outside_prefill_graph=True),),
    hook=BoundHook(log_decay=_log_decay, heads=_heads),
    state=StateLayout(conv=("conv_dim", "window"), temporal=("heads", "dv", "dk"), twin=("heads", "dk", "dv")),
    twin=NaiveTwin(replay=_replay, random_tail=_random_tail),
)
