"""Mamba-2 (Nemotron-H, Falcon-H1, Granite-4, ...): the kind's spec (`KIND`).

Replay path (SGLang 0.5.23), two seams, the mixer's SSD scan call:
- `srt/layers/attention/hybrid_linear_attn_backend.py::Mamba2AttnBackend.forward`, through which
  every Mamba-2 model runs each mixer: it knows the layer id and the forward batch (the scope);
- `srt/layers/attention/mamba/mamba.py: mamba_chunk_scan_combined`, the module global
  `MambaMixer2.forward` calls with the prefill rows' raw time steps `dt`, `A`, `dt_bias`,
  `dt_softplus` and `dt_limit` (whatever it is bound to: SGLang's Triton kernel on a GPU, the torch
  op of `patches/cpu/mamba2.py` on CPU, so the bound patch is applied after it). Prefill rows come
  first in the packed batch, so the batch's tail rows index `dt` directly.

Bound hook: A x dt_t per token and head, dt_t discretized as the scan does (bias, softplus, clamp);
h(L) - h_replayed(L) = exp(A sum_tail dt_t) h(L - W) per head, an equality
(`hybrid_kernels.replay_bound.mamba2_replay_bound`). State: [H, head_dim, d_state] in SGLang's pool
and in the twin (`hybrid_kernels.mamba2`).
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

#: the SSD scan's defaults for the keywords the hook reads
NO_LIMIT = (0.0, float("inf"))


def mamba2_log_decay(dt: torch.Tensor, A: torch.Tensor, dt_bias: torch.Tensor | None = None,
                     dt_softplus: bool = False,
                     dt_limit: tuple[float, float] = NO_LIMIT) -> torch.Tensor:
    """dt [n, heads] (as the SSD scan receives it), A [heads] (negative) -> A dt_t [n, heads] fp32,
    dt_t discretized as the scan does (bias, softplus, clamp to dt_limit)."""
    import torch.nn.functional as F

    step = dt.float()
    if dt_bias is not None:
        step = step + dt_bias.float()
    if dt_softplus:
        step = F.softplus(step)
    lo, hi = dt_limit
    if lo > 0.0 or hi != float("inf"):
        step = step.clamp(min=lo, max=hi)
    return A.float() * step


def _scope(args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> Scope:
    """`Mamba2AttnBackend.forward(self, mixer, hidden_states, output, layer_id, forward_batch, ...)`."""
    return Scope(call_arg(args, kwargs, 5, "forward_batch"), call_arg(args, kwargs, 4, "layer_id"),
                 call_arg(args, kwargs, 1, "mixer"))


def _gates(args: tuple[Any, ...], kwargs: Mapping[str, Any], layer: Any) -> Gates:
    """`mamba_chunk_scan_combined(x, dt, A, ..., dt_bias=, dt_softplus=, dt_limit=)`: the raw `dt`."""
    return Gates(call_arg(args, kwargs, 1, "dt"), {
        "A": call_arg(args, kwargs, 2, "A"), "dt_bias": kwargs.get("dt_bias"),
        "dt_softplus": bool(kwargs.get("dt_softplus", False)), "dt_limit": kwargs.get("dt_limit", NO_LIMIT)})


def _log_decay(rows: torch.Tensor, params: Mapping[str, Any]) -> torch.Tensor:
    return mamba2_log_decay(rows, params["A"], params["dt_bias"], params["dt_softplus"], params["dt_limit"])


def _heads(params: Mapping[str, Any]) -> int:
    return int(params["A"].numel())


def _replay(inputs: Mapping[str, torch.Tensor], state: torch.Tensor) -> torch.Tensor:
    """The SSD scan (`scan_segment`, quadratic form) from `state` [H, P, N]."""
    from hybrid_kernels.mamba2 import ScanInputs, scan_segment

    seq = ScanInputs(inputs["x"], inputs["dt"], inputs["A"], inputs["B"], inputs["C"], None, None)
    _, end = scan_segment(seq, state.float())
    return end


def _random_tail(generator: torch.Generator, tokens: int, heads: int) -> TwinTail:
    """Raw time steps as the scan receives them; the twin's dt through `discretize_dt`."""
    import torch

    from hybrid_kernels.mamba2 import discretize_dt

    P, N = 4, 6
    dt_raw = torch.randn(tokens, heads, generator=generator) - 2.0
    A = -torch.rand(heads, generator=generator) * 2.0 - 0.1
    dt_bias = torch.randn(heads, generator=generator) * 0.5
    params = {"A": A, "dt_bias": dt_bias, "dt_softplus": True, "dt_limit": NO_LIMIT}
    inputs = {"x": torch.randn(tokens, heads, P, generator=generator), "A": A,
              "dt": discretize_dt(dt_raw, dt_bias, True, NO_LIMIT),
              "B": torch.randn(tokens, heads, N, generator=generator),
              "C": torch.randn(tokens, heads, N, generator=generator)}
    return TwinTail(inputs, Gates(dt_raw, params), (heads, P, N))


KIND = LinearKind(
    name="mamba2",
    layer_classes=("sglang.srt.layers.attention.mamba.mamba:MambaMixer2",),
    seams=(GateSeam("sglang.srt.layers.attention.hybrid_linear_attn_backend:Mamba2AttnBackend.forward", scope=_scope),
           GateSeam("sglang.srt.layers.attention.mamba.mamba:mamba_chunk_scan_combined", gates=_gates)),
    hook=BoundHook(log_decay=_log_decay, heads=_heads),
    state=StateLayout(conv=("conv_dim", "window"), temporal=("heads", "head_dim", "d_state"),
                      twin=("heads", "head_dim", "d_state")),
    twin=NaiveTwin(replay=_replay, random_tail=_random_tail),
    scalar_decay=True,
)
