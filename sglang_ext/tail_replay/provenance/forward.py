"""The replayed state's error bound of one request, from the gates of its own replayed tail (pure).

An approximate hit replays the tail [L - W, L) from a zero state instead of the exact state
S(L - W). The recurrences are affine in the state, so per linear layer and head
||S(L) - S_replayed(L)|| <= exp(sum over the tail of the per-token log-decay) x ||S(L - W)||
(`hybrid_kernels.replay_bound` derives it). Each linear-layer kind computes its per-token log-decay from its own gates (its `BoundHook`, in
the registry `linear_kinds`: GDN g_t = -exp(A_log) softplus(a_t + dt_bias), SGLang's
`fused_gdn_gating`; Mamba-2 A dt_t, dt_t = softplus(dt_raw_t + dt_bias) clamped to dt_limit, an
equality).

During the replay the forward sees each linear layer's gate inputs for the packed extend batch
(`patches/tail_replay/linear_bound.py`, at every registered kind's seams). `BoundSegments` says
which rows of that batch belong to which request's replayed tail; per layer, one gather and one
segment sum add the rows' log-decay into each request's `TailDecay` (no host sync). A tail split over
prefill chunks is summed over the chunks. At the output, `summarize` turns the sums into the factor
(one host sync per request).

No SGLang import; torch is imported only where tensors are computed on.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    import torch


class HeadShards(Protocol):
    """How the ranks of a tensor-parallel group that each hold a shard of a layer's heads make
    every bound decision alike: each rank sees only its own heads' gates, so a max over heads
    taken on one rank differs from the next rank's, and so would every threshold decision read
    from it (plans, stored bounds, state order). Called in the forward, where every rank of the
    group runs the same batch and the same layers in the same order."""

    def gather_heads(self, values: torch.Tensor) -> torch.Tensor:
        """[rows, this rank's heads] -> [rows, every rank's heads], the same on every rank."""
        ...

    def max_rows(self, values: torch.Tensor) -> torch.Tensor:
        """[n] -> the elementwise max over the ranks, the same on every rank."""
        ...


@dataclass(frozen=True)
class DistributedHeadShards:
    """`HeadShards` over a torch.distributed process group of `size` ranks (SGLang's
    attention-TP group, whose ranks hold a linear layer's heads in rank order)."""

    group: Any
    size: int

    def gather_heads(self, values: torch.Tensor) -> torch.Tensor:
        import torch
        import torch.distributed as dist

        values = values.contiguous()
        parts = [torch.empty_like(values) for _ in range(self.size)]
        dist.all_gather(parts, values, group=self.group)
        return torch.cat(parts, dim=-1)

    def max_rows(self, values: torch.Tensor) -> torch.Tensor:
        import torch.distributed as dist

        out = values.contiguous().clone()
        dist.all_reduce(out, op=dist.ReduceOp.MAX, group=self.group)
        return out


@dataclass
class TailDecay:
    """Per linear layer (SGLang layer id): the summed log-decay [heads] (fp32) of the request's
    replayed tail seen so far, and how many tail tokens the sum covers. Mutated only by `add`.

    Under tensor parallelism the sums hold every rank's heads (`BoundSegments.shards`), so every
    rank computes the same bound; `local_heads` keeps this rank's heads only, for a consumer that
    applies them per head to this rank's state shard (a chunk's transition, captured for another wing)."""

    sums: dict[int, torch.Tensor] = field(default_factory=dict)
    tokens: dict[int, int] = field(default_factory=dict)
    local_heads: bool = False

    def add(self, layer: int, log_decay_sum: torch.Tensor, tokens: int) -> None:
        if layer in self.sums:
            self.sums[layer] = self.sums[layer] + log_decay_sum
            self.tokens[layer] += tokens
        else:
            self.sums[layer] = log_decay_sum
            self.tokens[layer] = tokens


@dataclass(frozen=True)
class StateBound:
    """The factor per request: `state_bound` = max over linear layers and heads of
    exp(sum of the tail's log-decay); `per_layer` = the max over heads of each linear layer, in
    layer order. Relative to the dropped state: ||S(L) - S_replayed(L)|| <= factor x ||S(L - W)||."""

    state_bound: float
    per_layer: tuple[float, ...]


@dataclass(frozen=True)
class BoundSegments:
    """The rows of one packed extend batch inside approximate replayed tails.

    rows [n] (long): row indices in the batch; segment [n] (long): which entry of `decays` each row
    adds to; counts: rows per entry; end: one past the largest row (a gate tensor with fewer rows
    is not this batch's, and is not accumulated)."""

    rows: torch.Tensor
    segment: torch.Tensor
    decays: tuple[TailDecay, ...]
    counts: tuple[int, ...]
    end: int
    #: the tensor-parallel ranks holding the other heads (None: this rank holds every head)
    shards: HeadShards | None = field(default=None, compare=False)

    def accumulate(self, layer: int, log_decay_rows: torch.Tensor) -> None:
        """log_decay_rows [n, heads]: the log-decay of `rows` (in that order) at `layer`; adds each
        request's sum into its TailDecay (one segment sum, on the tensor's device; under tensor
        parallelism one gather of the sums over the ranks' heads, unless every decay keeps
        `local_heads`)."""
        import torch

        values = log_decay_rows.float()
        sums = torch.zeros(len(self.decays), values.shape[-1], dtype=torch.float32, device=values.device)
        sums.index_add_(0, self.segment.to(values.device), values)
        every = sums
        if self.shards is not None and not all(decay.local_heads for decay in self.decays):
            every = self.shards.gather_heads(sums)
        for i, (decay, count) in enumerate(zip(self.decays, self.counts)):
            decay.add(layer, sums[i] if decay.local_heads else every[i], count)


def bound_segments(tails: Sequence[tuple[TailDecay, int, int] | None], prefix_lens: Sequence[int],
                   extend_lens: Sequence[int], shards: HeadShards | None = None) -> BoundSegments | None:
    """The batch's replayed-tail rows. tails[i]: (the request's TailDecay, first and one-past-last
    position of its replayed tail), or None (no approximate replay); prefix_lens / extend_lens: the
    requests' extend segments in batch order. None when no row of the batch is in a tail."""
    import torch

    rows: list[torch.Tensor] = []
    segment: list[torch.Tensor] = []
    decays: list[TailDecay] = []
    counts: list[int] = []
    offset = 0
    for tail, prefix, extend in zip(tails, prefix_lens, extend_lens):
        if tail is not None:
            decay, start, end = tail
            lo, hi = max(prefix, start), min(prefix + extend, end)
            if hi > lo:
                rows.append(torch.arange(offset + lo - prefix, offset + hi - prefix))
                segment.append(torch.full((hi - lo,), len(decays), dtype=torch.long))
                decays.append(decay)
                counts.append(hi - lo)
        offset += extend
    if not rows:
        return None
    all_rows = torch.cat(rows)
    return BoundSegments(all_rows, torch.cat(segment), tuple(decays), tuple(counts), int(all_rows[-1]) + 1, shards)


def summarize(decay: TailDecay, replayed_tokens: int) -> StateBound | None:
    """The request's factor, or None where the forward did not see every replayed token at every
    linear layer it saw (a tail that ran inside a CUDA graph, or a layer kind without a hook).
    A zero window (nothing replayed) drops the whole state: factor 1."""
    import torch

    if replayed_tokens == 0:
        return StateBound(1.0, ())
    if not decay.sums or any(n != replayed_tokens for n in decay.tokens.values()):
        return None
    layers = sorted(decay.sums)
    per_layer = torch.stack([decay.sums[layer].max() for layer in layers]).double().exp().tolist()
    return StateBound(max(per_layer), tuple(per_layer))
