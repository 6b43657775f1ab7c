"""Chat messages -> SAE's typed spans: a chat prompt's tokens typed by the role of the message
that rendered them (``patches/sae/chat.py`` fills ``token_types`` with them). Pure Python."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

from .request import OUTPUT_TYPE, TypedSpan

ROLE_TYPES: Mapping[str, str] = {"system": "system", "developer": "system", "user": "user",
                                 "assistant": "response", "tool": "tool_output",
                                 "function": "tool_output"}


def chat_spans(prompt_ids: Sequence[int], roles: Sequence[str],
               render_prefix: Callable[[int], Sequence[int]],
               think: tuple[int, int] | None = None) -> tuple[TypedSpan, ...]:
    """Spans of a chat prompt by message role, as the chat template renders them.

    ``render_prefix(k)`` renders the first k messages (no generation prompt); message k-1
    covers the tokens between the renderings of k-1 and k messages (the template's own
    markers included), clamped to where that rendering stops agreeing with the prompt
    (templates that rewrite earlier turns). Tokens after the last message (the generation
    prompt) are ``response``. With ``think`` = (open id, close id), tokens of an assistant
    turn from an open marker through its close marker are ``reasoning``."""
    n = len(prompt_ids)
    bounds = [0]
    for k in range(1, len(roles) + 1):
        rendered = render_prefix(k)
        agree = 0
        for a, b in zip(rendered, prompt_ids):
            if a != b:
                break
            agree += 1
        bounds.append(min(max(agree, bounds[-1]), n))
    spans: list[TypedSpan] = []
    for k, role in enumerate(roles):
        start, end = bounds[k], bounds[k + 1]
        if end > start:
            kind = ROLE_TYPES.get(role, "unknown")
            spans.extend(_split_reasoning(prompt_ids, start, end, kind, think))
    if bounds[-1] < n:
        spans.extend(_split_reasoning(prompt_ids, bounds[-1], n, OUTPUT_TYPE, think))
    return tuple(s for s in spans if s.token_type != "unknown")


def _split_reasoning(ids: Sequence[int], start: int, end: int, kind: str,
                     think: tuple[int, int] | None) -> list[TypedSpan]:
    if kind != "response" or think is None:
        return [TypedSpan(start, end, kind)]
    open_id, close_id = think
    out, pos, i = [], start, start
    while i < end:
        if ids[i] == open_id:
            j = i
            while j < end and ids[j] != close_id:
                j += 1
            j = min(j + 1, end)
            if i > pos:
                out.append(TypedSpan(pos, i, kind))
            out.append(TypedSpan(i, j, "reasoning"))
            pos = i = j
        else:
            i += 1
    if pos < end:
        out.append(TypedSpan(pos, end, kind))
    return out
