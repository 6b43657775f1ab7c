"""SAE behind a radix tree: ``ServerSAE`` turns the tree's match / insert / evict events
(nodes described as ``PathNode``) into ``SAEPolicy`` calls, orders the recurrent-state
checkpoints by the rule beside the policy, and keeps what /metrics reports (``ServeStats``).
Pure Python (no SGLang, no torch): the SGLang seams (``sglang_adapter.py`` and
``patches/sae_*.py``) call it; the simulator drives the very same ``SAEPolicy`` through
``eval/trace_sim/cache.py``. One core, two adapters.

Contracts:

* An *entry* is one radix-tree node; its policy key is the digest of the tokens from the
  root to the node's end (``content_key``), so a node that is evicted and later inserted
  again (a new tree node) is the same key: SAE's ghost feedback (re-reference of an
  evicted entry) works across tree nodes, and a node split keeps the child's key.
* A node's token type is the type of its last token (what the request had reached there);
  tokens past the prompt (the cached output) are ``response``.
* Requests are numbered in arrival order; a session is its tenant and name, mapped to an int
  by a bounded table (``sessions.SessionTable``, ``max_sessions``): a session it evicts is
  forgotten by the policy and a request of it still in flight counts as of no session.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections import Counter, OrderedDict
from collections.abc import Callable, Hashable, Iterable, Sequence
from dataclasses import dataclass

from ..base import EntryInfo, RequestInfo
from ..sae import SAEPolicy
from ..sae.keys import RankClass
from ..sae.policy import cost_bucket
from .config import ServerConfig
from .nodes import PathNode, entry_info
from .request import SAERequest
from .sessions import SessionTable


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
        self._requests: OrderedDict[Hashable, RequestInfo] = OrderedDict()  # (tenant, rid) -> info
        self.sessions = SessionTable(config.max_sessions)
        self._ghosts: OrderedDict[bytes, int] = OrderedDict()  # evicted key -> tokens
        self.stats = ServeStats(evicted_tokens=Counter())

    # ----- time and requests --------------------------------------------------------
    def now(self) -> float:
        return float(self._ticks) if self.config.clock == "requests" else self._wall() - self._t0

    def request(self, rid: Hashable, record: SAERequest | None, prompt_tokens: int) -> RequestInfo:
        """The request's info; the first call for ``rid`` (of the record's tenant: a client's
        rid never reaches another tenant's request) numbers it, ticks the request clock and
        uses its session (``SessionTable.use``; the sessions that use evicts are ended in the
        policy). A later call whose session the table has evicted since gets the info without
        a session. Mutates: the request table (bounded), the session table, the policy
        (``end_session``)."""
        key = (record.tenant if record is not None else None, rid)
        info = self._requests.get(key)
        if info is None:
            self._ticks += 1
            session = None
            if record is not None and record.session is not None:
                session, evicted = self.sessions.use(record.tenant, record.session)
                for gone in evicted:
                    self.policy.end_session(gone)
            info = RequestInfo(index=self._ticks, time=self.now(), prompt_tokens=prompt_tokens,
                               session=session)
            self._requests[key] = info
            if len(self._requests) > 4096:
                self._requests.popitem(last=False)
        elif info.session is not None and not self.sessions.holds(info.session):
            info = self._requests[key] = dataclasses.replace(info, session=None)
        return info

    def _info(self, node: PathNode, token_type: str) -> EntryInfo:
        return entry_info(node, token_type, self.config.block_tokens)

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
        return None if key is None else self._handles[key]  # type: ignore[index]  # SAE's keys are bytes

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
