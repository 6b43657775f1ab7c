"""LinearKV in the server: configuration, per-request chunk plans and their summary (pure core:
no SGLang import; the adapter is `sglang_ext/linearkv/sglang_cache.py`, the request seam
`patches/linearkv_request.py`).

A request's prompt is `P | C_1 .. C_K | Q`: P (the exact prefix, e.g. the system prompt) is served
from the radix tree with Tail-Replay's exact-KV reuse; each chunk C_j was prefilled on its own (at
positions 0..n_j-1, from a zero linear state) and registered under the LinearKV namespace of the
tree; its attention KV is copied into the request and its keys re-rotated to their new offset; the
linear layers start Q from the state rule's seed (`predecessor`: the last chunk's cached end state
and conv window, LinearKV's "single cached state"; `zero`; `compose`); Q is prefilled. With the
selector `epic-k` the first k tokens of every chunk (`ChunkPlan.heads`) are recomputed in context
first, each from the state rule's seed for a span after the chunks before it. Nothing assembled is
ever inserted into the exact tree.

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

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

#: `--radix-cache-backend linearkv`
BACKEND_NAME = "linearkv"
#: key of the per-request summary in `meta_info["cached_tokens_details"]` and in custom_params
META_KEY = "linearkv"
#: state rules served by the server (the reference path also has packed variants); `compose` (exact
#: composition of the chunks' end states through their transitions) on Mamba-2 models only;
#: `replay` (or `replay-<r>`): KV-only, each recomputed span starts `r` tokens earlier from a zero
#: state, in context (Tail-Replay's idea applied to chunks), so no chunk state is read
SERVED_STATE_RULES = ("predecessor", "zero", "compose", "replay")
#: state rules that read no chunk state: their registrations keep only the chunks' KV
KV_ONLY_RULES = ("zero", "replay")
#: tokens replayed by state rule `replay` without a `-<r>`
DEFAULT_REPLAY_TOKENS = 64
#: state rules that need each chunk's transition (a per-head scalar decay on Mamba-2)
COMPOSING_RULES = ("compose",)
#: selector kinds served by the server: `none` (only the question is computed) and `epic`
#: (EPIC / LegoLink-k: also the first k tokens of every chunk, in context); the reference path
#: also has `cacheblend-r`
SERVED_SELECTORS = ("none", "epic")
#: EPIC's k when the selector is "epic" and no `k` is given
DEFAULT_EPIC_K = 16
#: radix-tree namespace (`extra_key`) of registered chunks, per model, then per tenant (see
#: `tenant_namespace`); KV events leave it out
NAMESPACE_PREFIX = "linearkv-chunk:"
#: `--mamba-radix-cache-strategy` values LinearKV serves (`auto` before SGLang resolves it; it
#: resolves to one of the first two). Under `extra_buffer` a registration keeps its end state at the
#: chunk's end, not on the tracking grid (`sglang_cache.LinearKVMambaComponent`).
SERVED_STRATEGIES = ("no_buffer", "extra_buffer", "auto", None)

_CONFIG_KEYS = ("selector", "k", "state", "min_chunk_tokens", "separator")
_CONFIG_WHERE = "--linearkv-config key '{}'"
_REQUEST_KEYS = ("chunks", "separator", "state", "selector", "register", "keep_state")


class LinearKVConfigError(ValueError):
    """A bad `--linearkv-config` (names the key)."""


@dataclass(frozen=True)
class LinearKVConfig:
    """`--linearkv-config` JSON.

    selector: which chunk tokens are recomputed in context: "none" (only the question), "epic"
        (EPIC-k: also the first k tokens of every chunk, in context, each chunk's head seeded by the
        state rule from the chunks before it) or "epic-<k>"; parsed to "none" or "epic-<k>".
    k: EPIC's k for selector "epic" (default 16), also for requests that ask for "epic".
    state: the linear layers' seed for the question ("predecessor" | "zero" | "compose"; compose:
        Mamba-2 models only, the exact composition of the chunks' zero-start end states through
        their decays exp(A sum dt), captured at registration, from P's state taken as zero).
    min_chunk_tokens: a declared chunk shorter than this is joined to the span after it (a chunk
        costs one cached state; tiny ones are not worth it).
    separator: server-wide separator string for text prompts (None: only per request).
    """

    selector: str = "none"
    k: int | None = None
    state: str = "predecessor"
    min_chunk_tokens: int = 16
    separator: str | None = None


def parse_config(text: str | Mapping[str, Any] | None) -> LinearKVConfig:
    """Parse and validate; raise LinearKVConfigError naming the key."""
    if text is None or text == "":
        return LinearKVConfig()
    raw = _load_json(text) if isinstance(text, str) else dict(text)
    if not isinstance(raw, dict):
        raise LinearKVConfigError("--linearkv-config must be a JSON object")
    unknown = sorted(set(raw) - set(_CONFIG_KEYS))
    if unknown:
        raise LinearKVConfigError(f"--linearkv-config: unknown key {unknown[0]!r}; known keys: {list(_CONFIG_KEYS)}")
    config = LinearKVConfig(**raw)
    k = epic_k(config.selector, config.k, _CONFIG_WHERE, LinearKVConfigError)
    config = replace(config, selector=selector_name(k), k=config.k if config.k is not None else (k or None))
    _check_state(config.state, "--linearkv-config key 'state'", LinearKVConfigError)
    n = config.min_chunk_tokens
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise LinearKVConfigError(f"--linearkv-config key 'min_chunk_tokens' must be an integer >= 1, got {n!r}")
    if config.separator is not None and (not isinstance(config.separator, str) or not config.separator):
        raise LinearKVConfigError(
            f"--linearkv-config key 'separator' must be a non-empty string, got {config.separator!r}")
    return config


def _load_json(text: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise LinearKVConfigError(f"--linearkv-config is not valid JSON: {exc}") from None


def epic_k(selector: Any, k: Any, where: str, error: type[ValueError]) -> int:
    """EPIC's k of a served selector ("none" -> 0; "epic" -> k, or DEFAULT_EPIC_K; "epic-<k>").
    `where` names a key when formatted with it ("--linearkv-config key '{}'"); `error` is raised."""
    if k is not None and (isinstance(k, bool) or not isinstance(k, int) or k < 0):
        raise error(f"{where.format('k')} must be an integer >= 0, got {k!r}")
    if selector == "none":
        return 0
    if selector == "epic":
        return DEFAULT_EPIC_K if k is None else k
    kind, _, arg = selector.partition("-") if isinstance(selector, str) else ("", "", "")
    if kind == "epic" and arg.isdigit():
        if k is not None and k != int(arg):
            raise error(f"{where.format('k')} = {k} contradicts selector {selector!r}")
        return int(arg)
    if kind == "cacheblend":
        raise error(f"{where.format('selector')}: {selector!r} is not served: CacheBlend picks its tokens by "
                    "KV deviation at the first attention layer, inside one forward over every chunk token, "
                    "which SGLang's layer loop does not expose; it runs on the reference path "
                    "(sglang_ext.linearkv.reference). Served: none, epic, epic-<k>")
    raise error(f"{where.format('selector')}: {selector!r} is not a selector; served: none, epic, epic-<k>")


def selector_name(k: int) -> str:
    return f"epic-{k}" if k else "none"


def state_rule(value: str) -> tuple[str, int]:
    """(served rule, tokens replayed) of a state value: "replay" -> ("replay", 64),
    "replay-<r>" -> ("replay", r), any other -> (value, 0). Unchecked."""
    if value == "replay":
        return "replay", DEFAULT_REPLAY_TOKENS
    kind, _, arg = value.partition("-") if isinstance(value, str) else ("", "", "")
    if kind == "replay" and arg.isdigit() and int(arg) > 0:
        return "replay", int(arg)
    return value, 0


def _check_state(value: Any, where: str, error: type[ValueError]) -> None:
    if not isinstance(value, str) or state_rule(value)[0] not in SERVED_STATE_RULES:
        raise error(f"{where}: {value!r} is not served; choose from {list(SERVED_STATE_RULES)} or replay-<r> "
                    "(r >= 1 tokens; packed rules run on the reference path)")


def check_server_flags(server_args: Any) -> None:
    """Start-up refusals for `--radix-cache-backend linearkv` (ValueError naming the flag); other
    backends pass."""
    if getattr(server_args, "radix_cache_backend", None) != BACKEND_NAME:
        return
    page_size = getattr(server_args, "page_size", None) or 1
    if page_size != 1:
        raise ValueError("--radix-cache-backend linearkv needs --page-size 1 (a chunk is reused only in full, "
                         f"and a page-aligned tree would cut its last page); got --page-size {page_size}")
    strategy = getattr(server_args, "mamba_radix_cache_strategy", None)
    if strategy not in SERVED_STRATEGIES:
        raise ValueError(f"--radix-cache-backend linearkv runs with --mamba-radix-cache-strategy "
                         f"{' / '.join(SERVED_STRATEGIES[:2])} (or auto, which SGLang resolves to one of them); "
                         f"got --mamba-radix-cache-strategy {strategy} (the lazy variant may skip a checkpoint "
                         "when its pre-allocation fails, and a chunk registration must keep its end state)")
    if getattr(server_args, "enable_hierarchical_cache", False):
        raise ValueError("--radix-cache-backend linearkv does not run with --enable-hierarchical-cache")
    if getattr(server_args, "enable_dp_attention", False):
        raise ValueError("--radix-cache-backend linearkv does not run with --enable-dp-attention (EPIC's "
                         "pre-pass forwards run on one rank's requests only)")
    if getattr(server_args, "enable_watermark", False):
        raise ValueError("--radix-cache-backend linearkv does not run with --enable-watermark (EPIC's pre-pass "
                         "forwards carry no sampling state)")


def namespace(model_id: str) -> str:
    """The radix-tree `extra_key` prefix under which a model's chunks are registered."""
    return NAMESPACE_PREFIX + model_id


def tenant_namespace(model_namespace: str, extra_key: str | None) -> str:
    """The `extra_key` of the chunks of a request whose own `extra_key` (SGLang's: the client's
    `extra_key` with its LoRA id appended) is `extra_key`: chunks are registered per tenant, as
    SGLang's own prefix cache keys prompts (the cache salt is kept apart, in the key's
    `cache_salt`). A registration sent with `extra_key = tenant_namespace(ns, client_key)` and the
    request's LoRA gets `tenant_namespace(ns, client_key + lora_id)` from SGLang, the key its
    request looks chunks up under."""
    return f"{model_namespace}|{extra_key or ''}"


def is_chunk_namespace(extra_key: str | None) -> bool:
    """Whether a radix key's `extra_key` is a chunk namespace (never a prompt's)."""
    return extra_key is not None and extra_key.startswith(NAMESPACE_PREFIX)


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


#: attribute on SGLang's Req holding its LinearKVRequest (set by the adapter at the request's match)
RECORD_ATTR = "_linearkv_record"


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
    pre-pass, or chunk locks its first forward's reads release (`patches/linearkv_prepass.py`)."""
    record = record_of(req)
    return record is not None and (bool(record.locks) or record.prepass is not None)


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


def plan_chunks(value: Mapping[str, Any], n_tokens: int, config: LinearKVConfig,
                can_compose: bool = True) -> ChunkPlan | None:
    """The chunk plan of a request with `custom_params.linearkv = value` and `n_tokens` prompt
    tokens; None when, after joining chunks shorter than `min_chunk_tokens`, none is left.
    `can_compose`: whether the model's linear layers can compose (Mamba-2). ValueError naming the
    field on a malformed value."""
    state = value.get("state", config.state)
    _check_state(state, "custom_params.linearkv.state", ValueError)
    state, replay = state_rule(state)
    if state in COMPOSING_RULES and not can_compose:
        raise ValueError(f"custom_params.linearkv.state {state!r} is served for Mamba-2 models only "
                         "(a GDN chunk's transition is a matrix per head; use predecessor or zero)")
    if "selector" in value:
        k = epic_k(value["selector"], config.k if value["selector"] == "epic" else None,
                   "custom_params.linearkv.{}", ValueError)
    else:
        k = epic_k(config.selector, None, _CONFIG_WHERE, ValueError)
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
    #: assembled KV slots not yet handed to the request's row (`sglang_cache`)
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
    #: a finished registration under extra_buffer donated its own state slot (`sglang_cache`)
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


def with_state(plan: ChunkPlan, state: str) -> ChunkPlan:
    return replace(plan, state=state)
