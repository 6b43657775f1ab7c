"""SAECache in a server: the request record, the server config and the event adapter that
turns a radix tree's match / insert / evict events into ``SAEPolicy`` calls.

Pure Python (no SGLang, no torch): the SGLang seams (``sglang_adapter.py`` and
``patches/sae_*.py``) describe tree nodes as ``PathNode`` records and call
``ServerSAE``; the simulator drives the very same ``SAEPolicy`` through
``eval/trace_sim/cache.py``. One core, two adapters.

Contracts:

* An *entry* is one radix-tree node; its policy key is the digest of the tokens from the
  root to the node's end (``content_key``), so a node that is evicted and later inserted
  again (a new tree node) is the same key: SAE's ghost feedback (re-reference of an
  evicted entry) works across tree nodes, and a node split keeps the child's key.
* A node's token type is the type of its last token (what the request had reached there);
  tokens past the prompt (the cached output) are ``response``.
* Requests are numbered in arrival order; sessions are strings mapped to ints.
"""

from __future__ import annotations

import bisect
import hashlib
import math
import time
from array import array
from collections import Counter, OrderedDict
from collections.abc import Callable, Hashable, Iterable, Mapping, Sequence
from dataclasses import dataclass, fields

from .base import TOKEN_TYPES, EntryInfo, RequestInfo
from .sae import SAEConfig, SAEConfigError, SAEPolicy
from .sae.keys import RankClass
from .sae.policy import cost_bucket

#: request fields, inside ``sampling_params.custom_params``
TYPES_FIELD = "token_types"
SESSION_FIELD = "session"
FIELD_PREFIX = "sampling_params.custom_params."

#: names a client may use for a span, and the core's token type they mean
TYPE_ALIASES: Mapping[str, str] = {
    "system": "system", "user": "user", "assistant": "response", "response": "response",
    "tool": "tool_output", "tool_output": "tool_output", "tool_call": "tool_call",
    "reasoning": "reasoning",
}
OUTPUT_TYPE = "response"  # type of cached output tokens (past the prompt)
#: recompute cost of a token at depth d is 1 + d / ATTENTION_TOKENS (attention grows with depth)
ATTENTION_TOKENS = 8192


class RequestFieldError(ValueError):
    """A request's SAE field is malformed; the message names the field (HTTP 400)."""


# ----- the per-request record --------------------------------------------------------
@dataclass(frozen=True)
class TypedSpan:
    """Tokens [start, end) of the prompt have ``token_type`` (a core type, TOKEN_TYPES)."""

    start: int
    end: int
    token_type: str


@dataclass(frozen=True)
class SAERequest:
    """What SAE knows about one request: typed prompt spans (sorted, disjoint) and the
    session it belongs to (None: unknown)."""

    spans: tuple[TypedSpan, ...] = ()
    session: str | None = None

    def type_at(self, position: int, prompt_len: int) -> str:
        """Token type of token ``position``: its span's, ``response`` past the prompt,
        ``unknown`` in the prompt outside every span."""
        if position >= prompt_len:
            return OUTPUT_TYPE
        i = bisect.bisect_right([s.start for s in self.spans], position) - 1
        if i >= 0 and position < self.spans[i].end:
            return self.spans[i].token_type
        return "unknown"


def parse_request(custom_params, prompt_len: int | None, session_id=None) -> SAERequest | None:
    """The record of a request from ``sampling_params.custom_params`` (``token_types``:
    ``[[start, end, type], ...]``, ``session``: str or int) and SGLang's own session id.
    ``prompt_len`` None skips the range check (done when the prompt is tokenized). Raises
    ``RequestFieldError`` naming the field. None when the request carries neither."""
    custom = custom_params or {}
    if not isinstance(custom, Mapping):
        raise RequestFieldError("sampling_params.custom_params must be a JSON object")
    spans = _parse_spans(custom.get(TYPES_FIELD), prompt_len)
    session = custom.get(SESSION_FIELD)
    if session is not None and (isinstance(session, bool) or not isinstance(session, (str, int))):
        raise RequestFieldError(f"{FIELD_PREFIX}{SESSION_FIELD} must be a string or an integer, "
                                f"got {type(session).__name__}")
    if session is None and session_id:
        session = session_id
    if not spans and session is None:
        return None
    return SAERequest(spans=spans, session=None if session is None else str(session))


def _parse_spans(raw, prompt_len: int | None) -> tuple[TypedSpan, ...]:
    if raw is None:
        return ()
    name = FIELD_PREFIX + TYPES_FIELD
    if not isinstance(raw, list):
        raise RequestFieldError(f"{name} must be a list of [start, end, type], got {type(raw).__name__}")
    spans, last_end = [], 0
    for i, item in enumerate(raw):
        where = f"{name}[{i}]"
        if not isinstance(item, (list, tuple)) or len(item) != 3:
            raise RequestFieldError(f"{where} must be [start, end, type], got {item!r}")
        start, end, kind = item
        if any(isinstance(v, bool) or not isinstance(v, int) for v in (start, end)):
            raise RequestFieldError(f"{where}: start and end must be integers, got {item!r}")
        if kind not in TYPE_ALIASES:
            raise RequestFieldError(f"{where}: unknown token type {kind!r}; "
                                    f"known: {sorted(TYPE_ALIASES)}")
        if not 0 <= start < end:
            raise RequestFieldError(f"{where}: needs 0 <= start < end, got {item!r}")
        if start < last_end:
            raise RequestFieldError(f"{where}: spans must be sorted and must not overlap "
                                    f"(starts at {start}, the previous one ends at {last_end})")
        if prompt_len is not None and end > prompt_len:
            raise RequestFieldError(f"{where}: end {end} is past the prompt ({prompt_len} tokens)")
        spans.append(TypedSpan(start, end, TYPE_ALIASES[kind]))
        last_end = end
    return tuple(spans)


def spans_to_field(spans: Iterable[TypedSpan]) -> list[list]:
    """The request-field form of ``spans`` (core type names, which the field accepts)."""
    return [[s.start, s.end, s.token_type] for s in spans]


# ----- chat messages -> spans ---------------------------------------------------------
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


def _split_reasoning(ids, start, end, kind, think) -> list[TypedSpan]:
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


# ----- server config ------------------------------------------------------------------
_SAE_KEYS = {f.name for f in fields(SAEConfig)}
SERVER_KEYS = ("block_tokens", "clock", "state_order")
#: ``state_order``: who orders the recurrent-state checkpoints a state-eviction walk frees
STATE_ORDERS = ("sae", "lru")
#: the ``state_order`` each backend gets when the config does not set it, from the live
#: kv-cache-tester replay (docs/saecache.md, "Live"): on the default backend a freed state takes
#: its whole leaf, and SAE's order cost reuse there; under Tail-Replay the state alone goes
DEFAULT_STATE_ORDER = {"default": "lru", "tail_replay": "sae"}


@dataclass(frozen=True)
class ServerConfig:
    """``--radix-eviction-policy-config`` of ``sae``: SAEConfig keys plus ``block_tokens``
    (tokens per SAE block: the unit of sizes and of the residence time) and ``clock``
    (``"wall"``: seconds; ``"requests"``: one tick per request, deterministic) and
    ``state_order`` (``"sae"``: SAE's rule orders the recurrent-state checkpoints a walk frees,
    ``ServerSAE.state_order``; ``"lru"``: SGLang's least-recently-used walk; ``None``, the
    default: per backend, ``DEFAULT_STATE_ORDER``)."""

    sae: SAEConfig = SAEConfig()
    block_tokens: int = 16
    clock: str = "wall"
    state_order: str | None = None

    def state_order_for(self, backend: str) -> str:
        """``"sae"`` or ``"lru"``: the state order on ``backend`` (``"default"`` or
        ``"tail_replay"``)."""
        return self.state_order or DEFAULT_STATE_ORDER[backend]


def parse_server_config(raw: Mapping | None) -> ServerConfig:
    """Validate the JSON object; raise ``SAEConfigError`` naming the key."""
    raw = dict(raw or {})
    for key in raw:
        if key not in _SAE_KEYS and key not in SERVER_KEYS:
            raise SAEConfigError(f"--radix-eviction-policy-config key {key!r} is not a setting of "
                                 f"'sae'; known: {sorted(_SAE_KEYS | set(SERVER_KEYS))}")
    block = raw.pop("block_tokens", 16)
    if isinstance(block, bool) or not isinstance(block, int) or block < 1:
        raise SAEConfigError(f"--radix-eviction-policy-config key 'block_tokens' must be an integer >= 1, got {block!r}")
    clock = raw.pop("clock", "wall")
    if clock not in ("wall", "requests"):
        raise SAEConfigError(f"--radix-eviction-policy-config key 'clock' must be 'wall' or 'requests', got {clock!r}")
    state_order = raw.pop("state_order", None)
    if state_order is not None and state_order not in STATE_ORDERS:
        raise SAEConfigError(f"--radix-eviction-policy-config key 'state_order' must be one of "
                             f"{list(STATE_ORDERS)} (or absent: per backend), got {state_order!r}")
    for f in fields(SAEConfig):
        if f.name in raw:
            value, default = raw[f.name], f.default
            kind = type(default)
            ok = (isinstance(value, bool) if kind is bool else
                  (not isinstance(value, bool) and isinstance(value, (int, float) if kind is float else kind)))
            if not ok:
                raise SAEConfigError(f"--radix-eviction-policy-config key {f.name!r} must be "
                                     f"{kind.__name__}, got {value!r}")
    try:
        sae = SAEConfig(**raw)
    except SAEConfigError as exc:
        raise SAEConfigError(f"--radix-eviction-policy-config: {exc}") from None
    return ServerConfig(sae=sae, block_tokens=block, clock=clock, state_order=state_order)


# ----- the event adapter --------------------------------------------------------------
def content_keys(token_ids: Sequence[int], ends: Sequence[int], namespace: str = "") -> list[bytes]:
    """Digests of ``token_ids[:end]`` for each of the increasing ``ends`` (one pass)."""
    h = hashlib.blake2b(namespace.encode(), digest_size=16)
    out, pos = [], 0
    for end in ends:
        h.update(array("q", token_ids[pos:end]).tobytes())
        pos = end
        out.append(h.copy().digest())
    return out


@dataclass(frozen=True)
class PathNode:
    """A tree node as SAE sees it. ``handle``: the cache's node object (opaque here);
    ``node_id``: its id (hashable, unique while it exists); ``key``: its content key."""

    handle: object
    node_id: Hashable
    key: bytes
    start: int
    n_tokens: int


@dataclass
class ServeStats:
    """What /metrics reports (totals since start-up)."""

    evicted_tokens: Counter  # (token_type, queue) -> tokens
    rereferenced_tokens: int = 0  # tokens of evicted entries that came back
    decisions: int = 0
    decision_ns: int = 0
    hook_ns: int = 0  # time in the match / insert hooks and the pre-eviction sync
    state_orders: int = 0  # recurrent-state eviction walks SAE ordered
    state_order_ns: int = 0  # time spent ordering them


class ServerSAE:
    """One ``SAEPolicy`` behind a radix tree. Mutates only its own state and the policy."""

    def __init__(self, config: ServerConfig, clock: Callable[[], float] = time.monotonic) -> None:
        self.config = config
        self.policy = SAEPolicy(config.sae)
        self._wall = clock
        self._t0 = clock()
        self._ticks = 0
        self._handles: dict[bytes, PathNode] = {}  # key -> the live node holding it
        self._key_of: dict[Hashable, bytes] = {}  # node id -> key
        self._tokens: dict[bytes, int] = {}  # key -> tokens the policy was last told
        self._evictable: set[bytes] = set()
        self._touched: dict[bytes, int] = {}  # key -> index of the request that last touched it
        self._requests: OrderedDict[Hashable, RequestInfo] = OrderedDict()  # rid -> info
        self._sessions: dict[str, int] = {}
        self._ghosts: OrderedDict[bytes, int] = OrderedDict()  # evicted key -> tokens
        self.stats = ServeStats(evicted_tokens=Counter())

    # ----- time and requests --------------------------------------------------------
    def now(self) -> float:
        return float(self._ticks) if self.config.clock == "requests" else self._wall() - self._t0

    def request(self, rid: Hashable, record: SAERequest | None, prompt_tokens: int) -> RequestInfo:
        """The request's info; the first call for ``rid`` numbers it (and ticks the
        request clock). Mutates: the request table (bounded), the session table."""
        info = self._requests.get(rid)
        if info is None:
            self._ticks += 1
            session = None
            if record is not None and record.session is not None:
                session = self._sessions.setdefault(record.session, len(self._sessions))
            info = RequestInfo(index=self._ticks, time=self.now(), prompt_tokens=prompt_tokens,
                               session=session)
            self._requests[rid] = info
            if len(self._requests) > 4096:
                self._requests.popitem(last=False)
        return info

    def _info(self, node: PathNode, token_type: str) -> EntryInfo:
        bt = self.config.block_tokens
        n = node.n_tokens
        cost = n * (1.0 + (node.start + n / 2) / ATTENTION_TOKENS)
        return EntryInfo(n_blocks=max(1, math.ceil(n / bt)), n_tokens=n, start_token=node.start,
                         token_type=token_type, compute_cost=cost)

    # ----- events -------------------------------------------------------------------
    def referenced(self, path: Sequence[PathNode], types: Sequence[str], request: RequestInfo,
                   hit: bool) -> None:
        """``path`` (root to leaf, root excluded) is cached and read by ``request``:
        unknown keys are admitted, changed sizes resized, and with ``hit`` (a match)
        known ones touched, once per request (a waiting request may be matched again). ``types[i]``: token type of ``path[i]``. Mutates: the policy."""
        policy = self.policy
        for node, kind in zip(path, types):
            key = node.key
            old = self._key_of.get(node.node_id)
            if old is not None and old != key:
                self._forget(old)  # the node object now holds other tokens (never in SGLang)
            if key not in self._tokens:
                came_back = self._ghosts.pop(key, None)
                if came_back is not None:
                    self.stats.rereferenced_tokens += came_back
                policy.admit(key, self._info(node, kind), request)
                self._tokens[key] = node.n_tokens
            else:
                if self._tokens[key] != node.n_tokens:
                    if key in self._evictable:  # SAE sizes change only while held
                        policy.set_evictable(key, False)
                        self._evictable.discard(key)
                    policy.resize(key, self._info(node, kind))
                    self._tokens[key] = node.n_tokens
                if hit and self._touched.get(key) != request.index:  # SGLang may re-match a waiting request
                    policy.touch(key, self._info(node, kind), request)
                    self._touched[key] = request.index
            self._handles[key] = node
            self._key_of[node.node_id] = key

    def knows(self, node_id: Hashable) -> bool:
        """Whether the node ``node_id`` is one of SAE's entries."""
        return node_id in self._key_of

    def set_evictable(self, node_id: Hashable, evictable: bool) -> None:
        key = self._key_of.get(node_id)
        if key is None or (key in self._evictable) == evictable:
            return
        self.policy.set_evictable(key, evictable)
        (self._evictable.add if evictable else self._evictable.discard)(key)

    def sync(self, evictable_ids: set, alive: Callable[[object], bool],
             describe: Callable[[object], tuple[PathNode, str]] | None = None,
             leaves: Iterable[object] = ()) -> None:
        """Bring the policy in line with the tree before an eviction walk: forget nodes the
        tree dropped on its own (``alive`` False, e.g. a state eviction that took a whole
        leaf), admit evictable ``leaves`` SAE never saw (``describe``), and set every known
        node's evictability from ``evictable_ids``. O(known nodes)."""
        for key in [k for k, n in self._handles.items() if not alive(n.handle)]:
            self._drop(key, external=True)
        if describe is not None:
            for leaf in leaves:
                node, kind = describe(leaf)
                if node.node_id not in self._key_of:
                    self.referenced([node], [kind], self.request(("orphan", node.node_id), None, 0), hit=False)
        for key, node in list(self._handles.items()):
            should = node.node_id in evictable_ids
            if (key in self._evictable) != should:
                self.policy.set_evictable(key, should)
                (self._evictable.add if should else self._evictable.discard)(key)

    def victim(self) -> PathNode | None:
        """The node to evict next (timed). Does not change what is cached."""
        t = time.perf_counter_ns()
        key = self.policy.victim(self.now())
        self.stats.decision_ns += time.perf_counter_ns() - t
        self.stats.decisions += 1
        return None if key is None else self._handles[key]

    def state_keep_value(self, node_id: Hashable, now: float) -> float:
        """How much SAE wants to keep the recurrent state held by node ``node_id``: the value
        density SAE's model gives the node's entry (its owner's reuse class and pace, age since
        the entry's last access), with the recompute cost of the whole path from the root to
        the node's end: a state saves recomputing its entire prefix, not only the node's own
        tokens (so a short tail node, e.g. a request's cached output, is not cheap to lose).
        ``-inf`` for a node SAE does not know. Mutates: as ``SAEPolicy.value`` (class stats
        created on first use)."""
        key = self._key_of.get(node_id)
        if key is None:
            return -math.inf
        policy = self.policy
        entry = policy.queues.entries.get(key)
        if entry is None:
            return -math.inf
        owner = policy.queues.owners[entry.owner]
        depth = entry.start + self._tokens[key]
        path = self._info(PathNode(None, node_id, key, 0, depth), entry.token_type)
        rank = RankClass(owner.klass, cost_bucket(path), owner.pace)
        return policy.value(rank, max(0.0, now - entry.t_last))

    def state_order(self, node_ids: Sequence[Hashable]) -> list[int]:
        """The rule beside the policy for recurrent-state checkpoints: given the nodes
        holding an unlocked state, least recently used first (``node_ids``), the order to
        free their states in (indices into ``node_ids``): lowest ``state_keep_value`` first,
        ties (and nodes SAE does not know, which go first) in the given LRU order. So the
        states kept are those on entries SAE expects back soonest, e.g. the end state of a
        session SAE expects to return. Timed; mutates only the stats."""
        t = time.perf_counter_ns()
        now = self.now()
        values = [self.state_keep_value(node_id, now) for node_id in node_ids]
        order = sorted(range(len(node_ids)), key=lambda i: (values[i], i))
        self.stats.state_orders += 1
        self.stats.state_order_ns += time.perf_counter_ns() - t
        return order

    def evicted(self, node_id: Hashable) -> None:
        """The tree removed the node ``node_id`` (its whole KV). Mutates: policy, ghosts."""
        key = self._key_of.get(node_id)
        if key is not None:
            self._drop(key, external=False)

    def _drop(self, key: bytes, external: bool) -> None:
        node = self._handles[key]
        entry = self.policy.queues.entries.get(key)
        queue = self.policy.queues.owners[entry.owner].queue if entry is not None else "?"
        kind = entry.token_type if entry is not None else "unknown"
        if key not in self._evictable:
            self.policy.set_evictable(key, True)  # SAE evicts only evictable entries
        self.policy.evicted(key, None, self.now())
        self.stats.evicted_tokens[(kind, "state" if external else queue)] += node.n_tokens
        self._ghosts[key] = node.n_tokens
        if len(self._ghosts) > max(self.config.sae.min_ghosts, 4 * len(self._handles)):
            self._ghosts.popitem(last=False)
        self._forget(key)

    def _forget(self, key: bytes) -> None:
        node = self._handles.pop(key, None)
        if node is not None and self._key_of.get(node.node_id) == key:
            del self._key_of[node.node_id]
        self._tokens.pop(key, None)
        self._touched.pop(key, None)
        self._evictable.discard(key)

    # ----- introspection ------------------------------------------------------------
    def cached_keys(self) -> list[bytes]:
        return list(self._handles)

    def learned(self) -> dict[str, float]:
        """The learned weights /metrics shows: the model's duel win rate against LRU, the
        residence time H, and per reuse class the median reuse time and rho."""
        state = self.policy.state
        out = {"model_win_rate": state.model_win_rate, "horizon_s": state.horizon_s}
        for klass, stats in state.classes.items():
            queue, st = klass
            name = f"{queue}/{st if isinstance(st, str) else f'{st[0]}:{st[1]:d}'}"
            out[f"median_reuse_s[{name}]"] = math.exp(stats.reuse_time.mu)
            out[f"reuse_prob[{name}]"] = stats.reuse_prob
        return out


__all__ = ["ATTENTION_TOKENS", "DEFAULT_STATE_ORDER", "FIELD_PREFIX", "OUTPUT_TYPE", "PathNode", "RequestFieldError",
           "ROLE_TYPES", "SAERequest", "SESSION_FIELD", "STATE_ORDERS", "ServeStats", "ServerConfig", "ServerSAE",
           "TOKEN_TYPES", "TYPES_FIELD", "TYPE_ALIASES", "TypedSpan", "chat_spans", "content_keys",
           "parse_request", "parse_server_config", "spans_to_field"]
