"""LinearKV in the server: the scheduler's per-request record and its meta_info summary (pure
core: no SGLang import; the configuration is `config`, the request's chunk plan `plan`, the adapter
`sglang_cache`, the request seam `patches/linearkv/request.py`). This module also serves the
names of `config` and `plan` (one import for the adapter, the patches and the tools).

A request's prompt is `P | C_1 .. C_K | Q`: P (the exact prefix, e.g. the system prompt) is served
from the radix tree with Tail-Replay's exact-KV reuse; each chunk C_j was prefilled on its own (at
positions 0..n_j-1, from a zero linear state) and registered under the LinearKV namespace of the
tree; its attention KV is copied into the request and its keys re-rotated to their new offset; the
linear layers start Q from the state rule's seed (`predecessor`: the last chunk's cached end state
and conv window, LinearKV's "single cached state"; `zero`; `compose`); Q is prefilled. With the
selector `epic-k` the first k tokens of every chunk (`ChunkPlan.heads`) are recomputed in context
first, each from the state rule's seed for a span after the chunks before it. Nothing assembled is
ever inserted into the exact tree.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from sglang_ext.linearkv.config import (
    BACKEND_NAME,
    COMPOSING_RULES,
    DEFAULT_EPIC_K,
    DEFAULT_REPLAY_TOKENS,
    KV_ONLY_RULES,
    META_KEY,
    NAMESPACE_PREFIX,
    SERVED_SELECTORS,
    SERVED_STATE_RULES,
    SERVED_STRATEGIES,
    LinearKVConfig,
    LinearKVConfigError,
    check_server_flags,
    epic_k,
    is_chunk_namespace,
    namespace,
    parse_config,
    selector_name,
    state_rule,
    tenant_namespace,
)
from sglang_ext.linearkv.plan import (
    ChunkPlan,
    composes,
    is_registration,
    join_short,
    keeps_state,
    plan_chunks,
    request_field,
    spans_of_segments,
    split_by_separator,
)

__all__ = ["BACKEND_NAME", "COMPOSING_RULES", "DEFAULT_EPIC_K", "DEFAULT_REPLAY_TOKENS", "KV_ONLY_RULES",
           "META_KEY", "NAMESPACE_PREFIX", "SERVED_SELECTORS", "SERVED_STATE_RULES", "SERVED_STRATEGIES",
           "LinearKVConfig", "LinearKVConfigError", "check_server_flags", "epic_k", "is_chunk_namespace",
           "namespace", "parse_config", "selector_name", "state_rule", "tenant_namespace",
           "ChunkPlan", "composes", "is_registration", "join_short", "keeps_state", "plan_chunks",
           "request_field", "spans_of_segments", "split_by_separator",
           "RECORD_ATTR", "LinearKVRequest", "summary", "fallback_record", "parse_record",
           "EXACT_FALLBACK", "MAY_BE_STRICT", "served_exactly", "record_of",
           "capture_of", "needs_worker", "meta_contribution", "register_hooks"]

#: attribute on SGLang's Req holding its LinearKVRequest (set by the adapter at the request's match)
RECORD_ATTR = "_linearkv_record"


@dataclass
class LinearKVRequest:
    """The scheduler's record of one request (set at its match, read by the cache, the meta and
    the metrics). May be mutated by: the linearkv cache (match, load, release)."""

    plan: ChunkPlan | None = None
    register: bool = False
    #: a registration that keeps its chunk's end state (else KV only)
    keep_state: bool = True
    #: the last match: tree prefix length (Tail-Replay's plan over P), chunk hits
    tree_prefix_len: int = 0
    chunks_hit: int = 0
    chunks_missed: int = 0
    #: set when the chunk KV was placed into the request's own slots (assembled)
    assembled: bool = False
    reused_tokens: int = 0
    recomputed_tokens: int = 0
    state_source: str = "none"
    #: registration of a chunk already cached: a throw-away prefill of its last token
    register_hit: bool = False
    #: why a request with chunks is served as a plain prefill without being planned (its chunks no
    #: longer fit the prompt SGLang cut under --allow-auto-truncate), or None
    fallback: str | None = None
    #: chunks the request declared (what a fallback reports missed)
    declared_chunks: int = 0
    recorded: bool = False
    # ---- the adapter's and the worker's per-request state (set and cleared by them)
    #: assembled KV slots not yet handed to the request's row (`assembly`)
    slots: Any = None
    #: locks on chunk nodes whose states the request's first forward reads (`prepass.py`)
    locks: list | None = None
    #: set once that forward is launched: a device event to wait on, or True (`prepass.py`)
    reads_done: Any = None
    #: pending EPIC pre-pass (`prepass.PrePass`), consumed by the worker
    prepass: Any = None
    #: a registration whose log-decay is summed during its prefill: (accumulator, first, end)
    capture: tuple | None = None
    #: its state is kept out of the tree at caching (freed at release)
    state_withheld: bool = False
    #: a finished registration under extra_buffer donated its own state slot (`mamba_component`)
    end_donated: bool = False
    extra: dict = field(default_factory=dict)

    def reset_match(self) -> None:
        self.tree_prefix_len, self.chunks_hit, self.chunks_missed = 0, 0, 0
        self.assembled, self.reused_tokens, self.recomputed_tokens = False, 0, 0
        self.state_source, self.register_hit = "none", False


def summary(record: LinearKVRequest) -> dict:
    """`meta_info.cached_tokens_details.linearkv` of a request with this record: chunks served
    from the cache or not (a miss: the request was prefilled in full), chunk tokens whose KV was
    reused, prompt tokens the forwards computed past the reused ones (EPIC's chunk heads
    included), the question's state and the selector."""
    out = {"chunks_hit": record.chunks_hit, "chunks_missed": record.chunks_missed,
           "reused_tokens": record.reused_tokens, "recomputed_tokens": record.recomputed_tokens,
           "state_source": record.state_source,
           "selector": record.plan.selector if record.plan is not None else "none"}
    if record.fallback is not None:
        out["fallback"] = record.fallback
    return out


def fallback_record(value: Mapping[str, Any], n_tokens: int, reason: str) -> LinearKVRequest:
    """The record of a request whose chunks cannot be planned on the prompt as served: a plain
    prefill, every declared chunk missed (its counts are set at the match)."""
    declared = value.get("chunks")
    missed = len(declared) if isinstance(declared, Sequence) and not isinstance(declared, (str, bytes)) else 0
    return LinearKVRequest(fallback=reason, declared_chunks=missed)


#: `fallback` of a request with chunks whose exactness is strict (`served_exactly`)
EXACT_FALLBACK = ("strict exactness ('exact', or 'exact_unless_pressed' not pressed): the chunks were not "
                  "assembled (their KV is context-free, never exact); the prompt was prefilled as sent")
#: `exactness` values under which a request may run strict (`exactness: "exact"`; "exact_unless_pressed"
#: unless its arrival is pressed, which only the scheduler knows): such a prompt's text is never split
#: at the separator on arrival (the server without cache would read the separators too)
MAY_BE_STRICT = ("exact", "exact_unless_pressed")


def served_exactly(record: LinearKVRequest) -> LinearKVRequest:
    """The record of a planned request with chunks whose exactness is strict (decided once, at its
    first match, from its resolved Tail-Replay config): a plain prefill of the whole prompt as
    sent, every chunk missed, `fallback` saying why (`EXACT_FALLBACK`)."""
    assert record.plan is not None
    return LinearKVRequest(fallback=EXACT_FALLBACK, declared_chunks=len(record.plan.chunks))


def parse_record(custom_params: Any, n_tokens: int, config: LinearKVConfig, *,
                 can_compose: bool) -> LinearKVRequest | None:
    """The scheduler's record of a request with these custom_params and `n_tokens` prompt tokens
    as served; None for a request without LinearKV fields. A chunk layout that no longer fits
    the prompt (validated on arrival, so only a prompt SGLang cut afterwards under
    --allow-auto-truncate) gives a fallback record: a plain prefill, and meta_info says why."""
    value = request_field(custom_params)
    if value is None:
        return None
    if is_registration(custom_params):
        return LinearKVRequest(register=True, keep_state=value.get("keep_state", True) is not False)
    try:
        return LinearKVRequest(plan=plan_chunks(value, n_tokens, config, can_compose=can_compose))
    except ValueError as exc:
        return fallback_record(value, n_tokens, f"chunks not served on the {n_tokens}-token prompt as served: {exc}")


def record_of(req: Any) -> LinearKVRequest | None:
    """The LinearKV record of SGLang's Req, or None (a request without chunks, or not matched yet)."""
    return getattr(req, RECORD_ATTR, None)


def capture_of(req: Any) -> tuple[Any, int, int] | None:
    """(log-decay accumulator, first, one-past-last position) of a chunk registration whose gates
    are summed during its prefill (the gate hooks' rows, `sglang_ext.hooks`; the chunk's transition
    for `compose`), or None."""
    record = record_of(req)
    return None if record is None else record.capture


def needs_worker(req: Any) -> bool:
    """Whether the worker acts on this request before or after its forward: a pending EPIC
    pre-pass, or chunk locks its first forward's reads release (`patches/linearkv/prepass.py`)."""
    record = record_of(req)
    return record is not None and (bool(record.locks) or record.prepass is not None)


def meta_contribution(req: Any) -> tuple[str, dict] | None:
    """("linearkv", summary) of a request with chunks (planned, or served plainly with a
    `fallback`), for `meta_info.cached_tokens_details` (a `sglang_ext.hooks` meta contributor)."""
    record = getattr(req, RECORD_ATTR, None)
    if record is None or record.register or (record.plan is None and not record.fallback):
        return None
    return META_KEY, summary(record)


def register_hooks() -> None:
    """LinearKV's additions to Tail-Replay's seams (`sglang_ext.hooks`): chunk registrations'
    log-decay capture (`compose`), the per-request summary, and the backend whose requests carry
    Tail-Replay fields (P is served with Tail-Replay). Idempotent."""
    from sglang_ext import hooks

    hooks.add_decay_capture(capture_of)
    hooks.add_meta_contributor(meta_contribution)
    hooks.add_request_backend(BACKEND_NAME)
