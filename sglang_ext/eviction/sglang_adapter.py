"""SGLang adapter of SAECache (``--radix-eviction-policy sae``): the strategy object SGLang's
tree core holds, the one accessor for the per-request record, and the translation of
SGLang tree nodes into ``serving.PathNode``. The seams that call it are
``patches/sae/policy.py`` (factory, CLI choice, start-up check), ``sae/tree_core.py``
(the Python tree core), ``sae/cache_events.py`` (match / insert), ``sae/full_eviction.py``
(the full-KV eviction walk), ``sae/request.py`` and ``sae/chat.py`` (request fields).

SAE orders the full-KV leaves (``victim()``) and, where the config's ``state_order`` is
``"sae"`` (the default under ``tail_replay``; ``"lru"``, SGLang's walk, is the default on the
default backend), through the rule beside it (``ServerSAE.state_order``: lowest keep value of
the node's entry first), the recurrent-state checkpoints (``SAEStateOrder``: on the default
backend through ``patches/sae/state_eviction.py``, under ``tail_replay`` as the state order
``"sae"`` registered in ``sglang_ext.hooks``; under ``tail_replay`` the state alone goes,
on the default backend a state on a leaf takes the leaf, which SAE then sees as an external
eviction, queue ``state``): docs/saecache.md.
"""

from __future__ import annotations

import functools
import logging
import time
from collections import deque

from sglang.srt.mem_cache.evict_policy import EvictionStrategy

from sglang_ext.hooks import StateOrder, add_state_order

from .serving import PathNode, SAERequest, ServerSAE, content_keys, parse_request, parse_server_config, tenant_of

logger = logging.getLogger(__name__)
POLICY_NAME = "sae"
#: the one attribute SAE keeps on SGLang's Req (its SAERequest)
_REQ_ATTR = "_sglang_ext_sae"


class SAEStrategy(EvictionStrategy):
    """What ``get_eviction_strategy("sae", config)`` builds. ``server`` drives the full-KV
    leaf eviction (see patches/sae/full_eviction.py); ``get_priority`` (last access) orders
    only walks SAE does not drive (host-tier eviction)."""

    def __init__(self, **config) -> None:
        self.server = ServerSAE(parse_server_config(config))

    def get_priority(self, node) -> float:
        return node.last_access_time


def strategy_of(tree_core) -> SAEStrategy | None:
    strategy = getattr(tree_core, "eviction_strategy", None)
    return strategy if isinstance(strategy, SAEStrategy) else None


def request_record(req) -> SAERequest:
    """The request's SAE record (typed spans, session, tenant), parsed once from
    ``sampling_params.custom_params``, SGLang's session id and the request's tree namespace
    (``extra_key``, ``cache_salt``) (validated at arrival by patches/sae/request.py, so parsing
    here cannot fail on a served request)."""
    record = req.__dict__.get(_REQ_ATTR)
    if record is None:
        custom = getattr(req.sampling_params, "custom_params", None)
        session = getattr(req, "session_id", None)
        tenant = tenant_of(getattr(req, "extra_key", None), getattr(req, "cache_salt", None))
        try:
            record = parse_request(custom, None, session, tenant)
        except ValueError:
            record = None
        req.__dict__[_REQ_ATTR] = record = record or SAERequest(tenant=tenant)
    return record


def node_path(tree_core, node) -> list:
    """Nodes root (excluded) -> ``node``. ``node`` may be a node or a node id."""
    if node is None:
        return []
    if not hasattr(node, "parent"):
        node = tree_core.node_by_id(node)
    root, path = tree_core.root_node, []
    while node is not None and node is not root:
        path.append(node)
        node = node.parent
    path.reverse()
    return path


def _namespace(node) -> str:
    key = node.key
    return tenant_of(getattr(key, "extra_key", None), getattr(key, "cache_salt", None))


def describe(path: list, token_ids) -> list[PathNode]:
    """PathNodes of ``path`` whose tokens are ``token_ids`` from the root."""
    if not path:
        return []
    ends, total = [], 0
    for node in path:
        total += len(node.key)
        ends.append(total)
    keys = content_keys(token_ids[:total], ends, _namespace(path[0]))
    return [PathNode(node, node.id, key, end - len(node.key), len(node.key))
            for node, key, end in zip(path, keys, ends)]


def describe_leaf(tree_core, leaf) -> tuple[PathNode, str]:
    """A node SAE has not seen on any request path (rare: built by a walk SAE does not
    hook): its tokens from the tree, type unknown."""
    path = node_path(tree_core, leaf)
    tokens = [t for n in path for t in n.key.token_ids[: len(n.key)]]
    return describe(path, tokens)[-1], "unknown"


def on_request_path(tree_core, req, last_node, token_ids, hit: bool) -> None:
    """Tell SAE that ``req`` matched (``hit``) or cached the path ending at ``last_node``."""
    strategy = strategy_of(tree_core)
    if strategy is None or req is None:
        return
    t0 = time.perf_counter_ns()
    try:
        _on_request_path(strategy.server, tree_core, req, last_node, token_ids, hit)
    finally:
        strategy.server.stats.hook_ns += time.perf_counter_ns() - t0


def _on_request_path(server: ServerSAE, tree_core, req, last_node, token_ids, hit: bool) -> None:
    path = node_path(tree_core, last_node)
    if not path:
        return
    record = request_record(req)
    prompt_len = len(req.origin_input_ids)
    nodes = describe(path, token_ids)
    types = [record.type_at(n.start + n.n_tokens - 1, prompt_len) for n in nodes]
    server.referenced(nodes, types, server.request(req.rid, record, prompt_len), hit)
    leaves = tree_core.evictable_device_leaves
    for node in path:
        server.set_evictable(node.id, node in leaves)


def orders_states(tree_core, backend: str) -> bool:
    """Whether SAE orders the recurrent-state checkpoints of ``tree_core`` on ``backend``
    (``"default"`` or ``"tail_replay"``): the policy is SAE's and its config's ``state_order``
    (or the backend's default, ``serving.DEFAULT_STATE_ORDER``) is ``"sae"``."""
    strategy = strategy_of(tree_core)
    return strategy is not None and strategy.server.config.state_order_for(backend) == "sae"


def state_eviction_order(tree_core, lru) -> list:
    """The nodes holding an unlocked device state of ``lru`` (a Mamba component's LRU list),
    in the order SAE frees their states (``ServerSAE.state_order``). Locked states (a running
    request's, a checkpoint a planned hit copies) are never in it. Empty unless the tree
    core's policy is SAE's."""
    strategy = strategy_of(tree_core)
    if strategy is None:
        return []
    nodes, node = [], lru.get_lru_no_lock()
    while node is not None:
        nodes.append(node)
        node = lru.get_prev_no_lock(node)
    return [nodes[i] for i in strategy.server.state_order([n.id for n in nodes])]


class SAEStateOrder(StateOrder):
    """SAE's state order over one Mamba component's state LRU: at a walk's start, every unlocked
    device state in SAE's order (``state_eviction_order``); each step, the next of them still
    held and unlocked; at the end, the ordering time goes to /metrics. Needs the tree core and the
    component type. Runs Tail-Replay's state-only walk (registered as ``"sae"``, see
    ``register_policy``) and SGLang's own walk on the default backend
    (``patches/sae/state_eviction.py``)."""

    def __init__(self, tree_core, component_type) -> None:
        self.tree_core = tree_core
        self.component_type = component_type
        self.order: deque = deque()

    def start(self, request_cnt: int) -> None:
        """May mutate: the walk's order, SAE's stats (an ordering)."""
        self.order = deque(state_eviction_order(self.tree_core, self.tree_core.lru_lists[self.component_type]))

    def next_victim(self):
        """May mutate: the walk's order (the nodes up to the victim leave it)."""
        ct = self.component_type
        lru = self.tree_core.lru_lists[ct]
        while self.order:
            node = self.order.popleft()
            data = node.component_data[ct]
            if lru.in_list(node) and data.value is not None and data.lock_ref == 0:
                return node
        return None

    def end(self) -> None:
        """May mutate: the walk's order (emptied), /metrics."""
        self.order = deque()
        strategy = strategy_of(self.tree_core)
        if strategy is not None:
            publish_metrics(strategy)   # the ordering time reaches /metrics


def orders_tail_replay_states(tree_core) -> bool:
    """Whether SAE's order runs a walk of Tail-Replay's state-only walk on ``tree_core``: SAE
    orders states on the ``tail_replay`` backend (``orders_states``), and neither HiCache nor the
    session radix cache is on (their state walks stay the backend's)."""
    return (not tree_core.enable_session_radix_cache and not tree_core.enable_hicache
            and orders_states(tree_core, "tail_replay"))


def register_state_order() -> None:
    """SAE's state order for Tail-Replay's state-only walk, through the extension point
    ``sglang_ext.hooks.add_state_order`` (idempotent). May mutate: the hooks' state order registry."""
    add_state_order(POLICY_NAME, lambda site: SAEStateOrder(site.tree_core, site.component_type),
                    chosen_when=orders_tail_replay_states)


@functools.lru_cache(maxsize=1)
def _metrics():
    from prometheus_client import Counter, Gauge

    return {
        "evicted": Counter("sglang_ext:sae_evicted_tokens", "Tokens SAE's cache evicted, by token type and queue",
                           ["token_type", "queue"]),
        "reref": Counter("sglang_ext:sae_rereferenced_evicted_tokens",
                         "Tokens of evicted entries that a later request brought back"),
        "decisions": Counter("sglang_ext:sae_decisions", "Eviction decisions (victim choices)"),
        "decision_s": Counter("sglang_ext:sae_decision_seconds", "Time spent choosing victims"),
        "hook_s": Counter("sglang_ext:sae_hook_seconds",
                          "Time spent in SAE's match / insert hooks and its pre-eviction sync"),
        "state_order_s": Counter("sglang_ext:sae_state_order_seconds",
                                 "Time spent ordering recurrent-state checkpoints for eviction"),
        "learned": Gauge("sglang_ext:sae_learned", "SAE's learned parameters", ["name"],
                         multiprocess_mode="mostrecent"),
    }


class _Published:
    """The totals last pushed to Prometheus (counters take deltas)."""

    def __init__(self) -> None:
        self.evicted, self.reref, self.decisions, self.decision_ns, self.hook_ns = {}, 0, 0, 0, 0
        self.state_order_ns = 0


def publish_metrics(strategy: SAEStrategy) -> None:
    """Push ``strategy.server``'s totals to /metrics (called after each eviction walk)."""
    try:
        _publish(strategy, _metrics())
    except Exception as exc:  # metrics must never take the scheduler down
        if not _failed:
            _failed.append(exc)
            logger.warning("sae: /metrics not updated (%s: %s)", type(exc).__name__, exc)


_failed: list = []


def _publish(strategy: SAEStrategy, metrics: dict) -> None:
    server, last = strategy.server, strategy.__dict__.setdefault("_published", _Published())
    stats = server.stats
    for (kind, queue), tokens in stats.evicted_tokens.items():
        delta = tokens - last.evicted.get((kind, queue), 0)
        if delta:
            metrics["evicted"].labels(token_type=kind, queue=queue).inc(delta)
            last.evicted[(kind, queue)] = tokens
    if stats.rereferenced_tokens > last.reref:
        metrics["reref"].inc(stats.rereferenced_tokens - last.reref)
        last.reref = stats.rereferenced_tokens
    if stats.decisions > last.decisions:
        metrics["decisions"].inc(stats.decisions - last.decisions)
        metrics["decision_s"].inc((stats.decision_ns - last.decision_ns) / 1e9)
        last.decisions, last.decision_ns = stats.decisions, stats.decision_ns
    if stats.hook_ns > last.hook_ns:
        metrics["hook_s"].inc((stats.hook_ns - last.hook_ns) / 1e9)
        last.hook_ns = stats.hook_ns
    if stats.state_order_ns > last.state_order_ns:
        metrics["state_order_s"].inc((stats.state_order_ns - last.state_order_ns) / 1e9)
        last.state_order_ns = stats.state_order_ns
    for name, value in server.learned().items():
        metrics["learned"].labels(name=name).set(value)


def register_policy() -> None:
    """Make ``sae`` a factory and a CLI choice of ``--radix-eviction-policy``, and SAE's state
    order one of Tail-Replay's walk (``register_state_order``); idempotent. Runs in every patched
    process (``patches/sae/policy.py``) and in the plugin's main process (``sglang_ext.plugin``)."""
    from sglang.srt.arg_groups.choices import RADIX_EVICTION_POLICY_CHOICES, add_radix_eviction_policy_choices
    from sglang.srt.mem_cache import utils

    utils._EVICTION_POLICY_FACTORIES.setdefault(POLICY_NAME, SAEStrategy)
    register_state_order()
    if POLICY_NAME not in RADIX_EVICTION_POLICY_CHOICES:
        add_radix_eviction_policy_choices([POLICY_NAME])


def check_server_args(server_args) -> None:
    """Start-up check (main process): the config parses; raises ValueError naming the key."""
    if getattr(server_args, "radix_eviction_policy", None) != POLICY_NAME:
        return
    parse_server_config(server_args.radix_eviction_policy_config)
