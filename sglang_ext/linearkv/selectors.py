"""Selectors: which chunk tokens a PIC request recomputes in context (pure core).

Positions are global token offsets in the assembled prompt `P | C_1 .. C_K | Q`. Chunk spans are
half-open `(start, end)`; the question span is always recomputed, the prefix P never.

- `none`: only the question (naive PIC).
- `epic-k` (EPIC / LegoLink-k): the first k tokens of every chunk (clipped to its length).
- `cacheblend-r`: the top floor(r * n_chunk_tokens) chunk tokens by KV deviation (fresh minus
  cached KV at the check layer, the first full-attention layer on hybrids), ties to the earlier.

Spec strings: "none", "epic-16", "cacheblend-0.15" (also "cacheblend-15" meaning 15 %).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

Span = tuple[int, int]
SELECTOR_KINDS = ("none", "epic", "cacheblend")


@dataclass(frozen=True)
class Selector:
    kind: str
    k: int = 0
    ratio: float = 0.0

    @property
    def name(self) -> str:
        if self.kind == "epic":
            return f"epic-{self.k}"
        if self.kind == "cacheblend":
            return f"cacheblend-{round(self.ratio * 100):g}"
        return self.kind

    @property
    def needs_check_layer(self) -> bool:
        """True when the selection depends on KV deviation at the check layer."""
        return self.kind == "cacheblend"

    def plan(self, chunks: Sequence[Span], suffix: Span) -> list[int]:
        """Recomputed positions of a static selector, sorted (question included)."""
        if self.needs_check_layer:
            raise ValueError(f"selector {self.name} selects at the check layer: call select()")
        _check_spans(chunks, suffix)
        out: list[int] = []
        if self.kind == "epic":
            for start, end in chunks:
                out.extend(range(start, min(end, start + self.k)))
        out.extend(range(*suffix))
        return out

    def select(self, deviation: torch.Tensor, chunks: Sequence[Span], suffix: Span) -> list[int]:
        """CacheBlend: top floor(ratio * chunk tokens) chunk positions by `deviation` (indexed by
        global position, at least up to the last chunk end), plus the question, sorted."""
        if not self.needs_check_layer:
            return self.plan(chunks, suffix)
        _check_spans(chunks, suffix)
        cand = torch.tensor([p for s, e in chunks for p in range(s, e)], dtype=torch.long)
        n = int(self.ratio * len(cand))
        chosen: list[int] = []
        if n > 0:
            scores = deviation.detach().float().cpu()[cand]
            # stable: equal scores keep the earlier position
            order = torch.sort(scores, descending=True, stable=True).indices[:n]
            chosen = sorted(cand[order].tolist())
        return chosen + list(range(*suffix))


def _check_spans(chunks: Sequence[Span], suffix: Span) -> None:
    last = None
    for s, e in (*chunks, suffix):
        if not (0 <= s < e) and not (s == e and (s, e) == suffix):
            raise ValueError(f"bad span ({s}, {e})")
        if last is not None and s < last:
            raise ValueError(f"spans overlap or are out of order at ({s}, {e})")
        last = e


def parse_selector(spec: str) -> Selector:
    """'none' | 'epic-<k>' | 'cacheblend-<r>' (r a fraction <= 1 or a percentage)."""
    kind, _, arg = spec.partition("-")
    if kind == "none" and not arg:
        return Selector("none")
    try:
        if kind == "epic":
            k = int(arg)
            if k < 0:
                raise ValueError
            return Selector("epic", k=k)
        if kind == "cacheblend":
            r = float(arg)
            r = r / 100 if r > 1 else r
            if not 0 <= r <= 1:
                raise ValueError
            return Selector("cacheblend", ratio=r)
    except ValueError:
        pass
    raise ValueError(f"bad selector {spec!r}: use none, epic-<k> (k >= 0) or cacheblend-<r> (0..1 or percent)")
