"""A LinearKV request's chunk plan (pure core: no SGLang import): its `custom_params.linearkv`
field and the one function that parses it into a `ChunkPlan` (`plan_chunks`; the tokenizer
validates every request with it on arrival, the scheduler plans with it again on the prompt as
served), with the separator-mode helpers.

Request fields (`sampling_params.custom_params.linearkv`):
- `{"chunks": [[start, end], ...]}`: token spans of the chunks in the prompt's token ids, sorted,
  contiguous (each starts where the last ended), non-empty, ending before the last prompt token;
- `{"separator": "<str>"}` (or the server's `separator`): the prompt text is `P sep C_1 sep .. sep Q`;
  the segments are tokenized one by one (so a chunk has the same ids wherever it appears) and the
  separators dropped;
- optional `"state"`: the request's state rule; optional `"selector"`: the request's selector
  (`"none"`, `"epic"` with the server's k, or `"epic-<k>"`).
Internal: `{"register": true, "keep_state": bool}` marks a chunk-registration prefill (sent by the
request seam); `keep_state` false (the request's rule reads no chunk state: `zero`, `replay`) keeps
only the chunk's KV, true also its end state (a registration that needs the state of a chunk held
without one prefills it again and adds the state).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from sglang_ext.linearkv.config import (
    COMPOSING_RULES,
    CONFIG_WHERE,
    KV_ONLY_RULES,
    META_KEY,
    LinearKVConfig,
    check_state,
    epic_k,
    selector_name,
    state_rule,
)

_REQUEST_KEYS = ("chunks", "separator", "state", "selector", "register", "keep_state")


@dataclass(frozen=True)
class ChunkPlan:
    """A request's layout: P = [0, prefix_end), chunks tile [prefix_end, question_start),
    Q = [question_start, n)."""

    chunks: tuple[tuple[int, int], ...]
    state: str
    #: EPIC's k (0: selector none): the first k tokens of every chunk are recomputed in context
    k: int = 0
    #: state rule `replay`: each recomputed span but the first head starts up to this many tokens
    #: earlier, from a zero state (never into P, a head or the span before it)
    replay: int = 0

    @property
    def prefix_end(self) -> int:
        return self.chunks[0][0]

    @property
    def question_start(self) -> int:
        return self.chunks[-1][1]

    @property
    def chunk_tokens(self) -> int:
        return self.question_start - self.prefix_end

    @property
    def seeds_zero(self) -> bool:
        """Whether every recomputed span starts from a zero state (`zero`; `replay`, whose spans
        start earlier to rebuild it)."""
        return self.state in KV_ONLY_RULES

    @property
    def heads(self) -> tuple[tuple[int, int], ...]:
        """The recomputed head span of every chunk, [c_j, c_j + min(k, n_j)) (EPIC); () for none.
        Under `replay` head j > 0 starts up to `replay` tokens earlier, not before head j-1's end."""
        if not self.k:
            return ()
        out, prev = [], self.prefix_end
        for j, (s, e) in enumerate(self.chunks):
            end = min(e, s + self.k)
            out.append((s if j == 0 else max(prev, s - self.replay), end))
            prev = end
        return tuple(out)

    @property
    def forward_start(self) -> int:
        """Where the request's own forward starts: the question, or under `replay` up to `replay`
        tokens before it (not into P or the last head)."""
        if not self.replay:
            return self.question_start
        floor = self.heads[-1][1] if self.k else self.prefix_end
        return max(floor, self.question_start - self.replay)

    @property
    def recomputed_chunk_tokens(self) -> int:
        """Chunk tokens computed in context (EPIC heads, replayed tails) rather than reused."""
        return self.head_tokens + self.question_start - self.forward_start

    @property
    def head_tokens(self) -> int:
        return sum(e - s for s, e in self.heads)

    @property
    def selector(self) -> str:
        return selector_name(self.k)


def request_field(custom_params: Any) -> Mapping[str, Any] | None:
    """The request's `custom_params.linearkv` object, or None; ValueError naming the field."""
    if custom_params is None:
        return None
    if not isinstance(custom_params, Mapping):
        raise ValueError("sampling_params.custom_params must be a JSON object")
    value = custom_params.get(META_KEY)
    if value is None:
        return None
    if not isinstance(value, Mapping):
        raise ValueError("custom_params.linearkv must be a JSON object, e.g. {\"chunks\": [[0, 512]]}")
    unknown = sorted(set(value) - set(_REQUEST_KEYS))
    if unknown:
        raise ValueError(f"custom_params.linearkv: unknown key {unknown[0]!r}; known keys: {list(_REQUEST_KEYS)}")
    return value


def composes(layer_types: Sequence[str] | None, model_type: str | None) -> bool:
    """Whether a model's linear layers are all Mamba-2 (their chunk transitions are scalar decays),
    from its HF config: GDN models (Qwen3-Next, Qwen3.5) mark layers "linear_attention"."""
    kinds = set(layer_types or ())
    return "linear_attention" not in kinds and not str(model_type or "").startswith(("qwen3_next", "qwen3_5"))


def keeps_state(plan: ChunkPlan) -> bool:
    """Whether the registrations a request with this plan sends keep their chunks' end states
    (its rule, or its EPIC heads' seeds, read them)."""
    return plan.state not in KV_ONLY_RULES


def is_registration(custom_params: Any) -> bool:
    field_ = request_field(custom_params) if isinstance(custom_params, Mapping) else None
    return bool(field_ and field_.get("register") is True)


def plan_chunks(value: Mapping[str, Any], n_tokens: int, config: LinearKVConfig, *,
                can_compose: bool) -> ChunkPlan | None:
    """The chunk plan of a request with `custom_params.linearkv = value` and `n_tokens` prompt
    tokens; None when, after joining chunks shorter than `min_chunk_tokens`, none is left.
    `can_compose`: whether the model's linear layers can compose (Mamba-2; no default: each
    caller states what its server's model does). The one parse site of the field's chunk plan
    (the tokenizer on arrival, the scheduler on the prompt as served). ValueError naming the
    field on a malformed value."""
    state = value.get("state", config.state)
    check_state(state, "custom_params.linearkv.state", ValueError)
    state, replay = state_rule(state)
    if state in COMPOSING_RULES and not can_compose:
        raise ValueError(f"custom_params.linearkv.state {state!r} is served for Mamba-2 models only "
                         "(a GDN chunk's transition is a matrix per head; use predecessor or zero)")
    if "selector" in value:
        k = epic_k(value["selector"], config.k if value["selector"] == "epic" else None,
                   "custom_params.linearkv.{}", ValueError)
    else:
        k = epic_k(config.selector, None, CONFIG_WHERE, ValueError)
    spans = _spans(value.get("chunks"), n_tokens)
    joined = join_short(spans, config.min_chunk_tokens)
    return ChunkPlan(tuple(joined), state, k, replay) if joined else None


def _spans(raw: Any, n_tokens: int) -> list[tuple[int, int]]:
    where = "custom_params.linearkv.chunks"
    if not isinstance(raw, Sequence) or isinstance(raw, (str, bytes)) or not raw:
        raise ValueError(f"{where} must be a non-empty list of [start, end] token spans")
    spans: list[tuple[int, int]] = []
    for i, span in enumerate(raw):
        ok = isinstance(span, Sequence) and len(span) == 2 and all(
            isinstance(x, int) and not isinstance(x, bool) for x in span)
        if not ok:
            raise ValueError(f"{where}[{i}] must be [start, end] (two integers), got {span!r}")
        start, end = span
        if not 0 <= start < end:
            raise ValueError(f"{where}[{i}] = {list(span)}: need 0 <= start < end")
        if spans and start != spans[-1][1]:
            raise ValueError(f"{where}[{i}] starts at {start} but chunk {i - 1} ends at {spans[-1][1]}: "
                             "chunks must be sorted and contiguous")
        spans.append((start, end))
    if spans[-1][1] >= n_tokens:
        raise ValueError(f"{where}: the last chunk ends at {spans[-1][1]} but the prompt has {n_tokens} tokens; "
                         "at least one question token must follow the chunks")
    return spans


def join_short(spans: Sequence[tuple[int, int]], min_tokens: int) -> list[tuple[int, int]]:
    """Join each span shorter than `min_tokens` to the span after it; a short last span is left
    to the question (dropped). Pure; keeps the spans contiguous."""
    out: list[tuple[int, int]] = []
    start = None
    for s, e in spans:
        start = s if start is None else start
        if e - start >= min_tokens:
            out.append((start, e))
            start = None
    return out


def split_by_separator(text: str, separator: str) -> list[str] | None:
    """`P sep C_1 sep .. sep Q` -> [P, C_1, .., Q]; None when the text holds no chunk (fewer than
    two separators)."""
    parts = text.split(separator)
    return parts if len(parts) >= 3 else None


def spans_of_segments(lengths: Sequence[int]) -> list[list[int]]:
    """Token spans of the chunks from the token counts of [P, C_1, .., C_K, Q] (empty chunks dropped)."""
    spans: list[list[int]] = []
    pos = lengths[0]
    for n in lengths[1:-1]:
        if n > 0:
            spans.append([pos, pos + n])
        pos += n
    return spans
