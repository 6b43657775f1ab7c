"""Provenance on the tree (SGLang adapter): what each node carries, the matched path read once per
match, and the Mamba component's provenance rules on insert, node split and insert overlap.

- A node's provenance (`provenance_of`): per token the bound of its KV, and its state's bound
  (`tail_replay.provenance.NodeProvenance`; absent: strictly exact); `answer_from`: where the
  inserting request's generated answer begins in the node's tokens.
- `MatchedPath`: the nodes of a matched path, root first, walked once per match (the branch-point
  track, the planner, the tail's KV slots and the repair rules all read it).
- `ProvenanceWriter` (a part of `TailReplayMambaComponent`): new leaves and stored states get
  the inserting request's bounds (the cache's `InsertContext`), a split keeps each half's own, an overlap lets
  fresher KV of a smaller bound replace an approximate node's.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any, NamedTuple

import torch
from sglang.srt.mem_cache.unified_cache.cache_action import FreeDeviceKV
from sglang.srt.mem_cache.unified_cache.components import ComponentType

from sglang_ext.tail_replay.metrics import record_stored_bound
from sglang_ext.tail_replay.planner import HitKind, ReplayPlan
from sglang_ext.tail_replay.provenance import bounds as provenance
from sglang_ext.tail_replay.provenance.bounds import CarryBound, NodeProvenance, PathProvenance
from sglang_ext.tail_replay.request import computed_from

if TYPE_CHECKING:
    from sglang_ext.tail_replay.provenance.writes import InsertContext

#: the attribute of a tree node holding its NodeProvenance (absent: strictly exact)
PROVENANCE_ATTR = "sglang_ext_provenance"
#: the attribute of a tree node whose state's shared-state repair was asked for: when (monotonic s;
#: removed when the node takes another state)
SHARED_REPAIR_ATTR = "sglang_ext_shared_repair_at"
#: the attribute of a tree node whose tokens from this offset on are the generated answer of the
#: request that inserted it (absent: prompt tokens only, or inserted without a request)
ANSWER_FROM_ATTR = "sglang_ext_answer_from"


def answer_from(node: Any) -> int | None:
    """Where, within a tree node's tokens, the inserting request's generated answer begins (None:
    none of them is one)."""
    return getattr(node, ANSWER_FROM_ATTR, None)


def provenance_of(node: Any) -> NodeProvenance | None:
    """A tree node's provenance, or None (strictly exact KV, and state if it holds one)."""
    return getattr(node, PROVENANCE_ATTR, None)


def set_provenance(node: Any, prov: NodeProvenance | None) -> None:
    """Store a node's provenance (a strictly exact one is stored as none). Mutates the node."""
    if prov is not None and prov.kv is not None and not bool((prov.kv > 0).any()):
        prov = NodeProvenance(None, prov.state)
    if prov is None or (prov.kv is None and prov.state == 0.0):
        if hasattr(node, PROVENANCE_ATTR):
            delattr(node, PROVENANCE_ATTR)
        return
    setattr(node, PROVENANCE_ATTR, prov)


def holds_state(node: Any, host: bool) -> bool:
    """Whether the node holds a state: on the device, or, where states go to the host, there."""
    data = node.component_data[ComponentType.MAMBA]
    return data.value is not None or (host and data.host_value is not None)


class MatchedPath:
    """The nodes of one matched path, root first (root excluded), with the depth each ends at.
    Walked once per match (`walk`); a deeper match over the same path (device + host) extends it
    by the part below. Mutated only by `node_at_depth` (a node split there is recorded)."""

    def __init__(self, nodes: list[Any]):
        self.nodes = nodes
        self.ends: list[int] = []
        depth = 0
        for node in nodes:
            depth += len(node.key)
            self.ends.append(depth)

    @classmethod
    def walk(cls, tree_core: Any, node: Any, known: MatchedPath | None = None) -> MatchedPath:
        """The path from the root to `node` (a tree node). A `known` path is reused where it holds
        `node` (its part down to it) or ends above it (only the nodes below its end are walked)."""
        root = tree_core.root_node
        if node is root:
            return cls([])
        if known is not None:
            for i, n in enumerate(known.nodes):
                if n is node:
                    return known if i == len(known.nodes) - 1 else cls(known.nodes[:i + 1])
        stop = known.nodes[-1] if known is not None and known.nodes else None
        below: list[Any] = []
        while node is not root and node is not None and node is not stop:
            below.append(node)
            node = node.parent
        head = known.nodes if stop is not None and node is stop else []
        return cls([*head, *below[::-1]])

    @property
    def depth(self) -> int:
        return self.ends[-1] if self.ends else 0

    @property
    def last_id(self) -> Any:
        return self.nodes[-1].id if self.nodes else None

    def upto(self, node_id: Any) -> MatchedPath:
        """The part of the path that ends at `node_id` (one of its nodes; the root: empty)."""
        for i, node in enumerate(self.nodes):
            if node.id == node_id:
                return MatchedPath(self.nodes[:i + 1])
        return MatchedPath([])

    def provenance(self, host: bool) -> PathProvenance:
        """The path's provenance (its KV bounds and states: on the device, and on the host where
        states go there)."""
        return provenance.path_provenance([(len(n.key), provenance_of(n), holds_state(n, host), n.id)
                                           for n in self.nodes])

    def node_at_depth(self, depth: int, root_id: Any, split: Callable[[Any, int], Any]) -> Any:
        """The id of the path's node that ends at `depth` (page-aligned), splitting the node that
        spans it with `split(node, head_len) -> head` (recorded here); `root_id` for 0."""
        if depth == 0:
            return root_id
        for i, end in enumerate(self.ends):
            if end == depth:
                return self.nodes[i].id
            if end > depth:
                node = self.nodes[i]
                head = split(node, len(node.key) - (end - depth))
                self.nodes.insert(i, head)
                self.ends.insert(i, depth)
                return head.id
        return self.last_id

    def kv_slots(self, start: int, end: int) -> torch.Tensor:
        """The tree's KV slots of [start, end) along the path (`end` <= its depth)."""
        chunks, first = [], 0
        for node, node_end in zip(self.nodes, self.ends):
            node_start = node_end - len(node.key)
            if node_end <= start:
                continue
            if node_start >= end:
                break
            if not chunks:
                first = node_start
            chunks.append(node.component_data[ComponentType.FULL].value)
        return torch.cat(chunks)[start - first:end - first].clone()


class ProvenanceWriter:
    """The Mamba component's provenance rules on insert, node split and insert overlap (a part of
    `TailReplayMambaComponent`). Needs the tree core, the component type, the cache's
    `inserting()`: what the running insert brings (an `provenance.writes.InsertContext`: every
    bound written here is asked of it) and the component's `free_state(value)` (SGLang's free of a
    state slot)."""

    def __init__(self, tree_core: Any, component_type: Any, *, inserting: Callable[[], InsertContext],
                 free_state: Callable[[Any], None]) -> None:
        self.tree_core = tree_core
        self.component_type = component_type
        self.inserting = inserting
        self.free_state = free_state

    def on_commit(self, node, is_new_leaf, params, result, cache_actions, *, stock: Callable[..., None]) -> None:
        """The new leaf's KV gets the inserting request's bounds at its positions, and a mark where
        the request's generated answer begins in it (`answer_from`); a state the tree takes gets
        the request's bound at its depth. An existing state of a larger bound is replaced by the
        request's (unless locked); a state the request asked a repair for and holds only inexactly
        is not taken (`InsertContext.awaits_repair_at`; SGLang frees it as a duplicate); otherwise
        `stock(node, is_new_leaf, params, result, cache_actions)` (SGLang's commit) stores it. May mutate: the node's provenance, answer mark
        and state, its shared-state repair mark (cleared when it takes a state), its place in the
        state LRU, and whatever `stock` mutates."""
        depth = result.prefix_len + (len(node.key) if is_new_leaf else 0)
        if is_new_leaf:
            prompt_len = self.inserting().prompt_len
            if prompt_len is not None and prompt_len < depth:
                setattr(node, ANSWER_FROM_ATTR, max(prompt_len - result.prefix_len, 0))
            if self.inserting().max_bound(result.prefix_len, depth) == 0.0:
                set_provenance(node, None)   # strictly exact KV (the common case: no tensor built)
                record_stored_bound("kv", 0.0)
            else:
                kv = self.inserting().bounds(result.prefix_len, depth)
                set_provenance(node, NodeProvenance(kv, 0.0))
                record_stored_bound("kv", float(kv.max()) if kv.numel() else 0.0)
        if params.mamba_value is None:
            return
        state_bound = self.inserting().state_bound(depth)
        if self.inserting().awaits_repair_at(depth, state_bound):
            result.mamba_exist = True   # SGLang frees the request's copy, as for a node holding one
            return
        cd = node.component_data[self.component_type]
        old = provenance_of(node)
        if not is_new_leaf and cd.value is not None and old is not None and old.state > state_bound \
                and cd.lock_ref == 0 and cd.host_value is None:
            self.free_state(cd.value)   # the tree's state was worse: take the request's
            cd.value = params.mamba_value
            self.tree_core.lru_lists[self.component_type].reset_node_mru(node)
        else:
            had_state = cd.value is not None
            stock(node, is_new_leaf, params, result, cache_actions)
            if had_state:
                return   # the tree keeps its own state (and its bound)
            if cd.host_value is not None and old is not None:
                state_bound = max(state_bound, old.state)   # the host copy is the node's state too
        if hasattr(node, SHARED_REPAIR_ATTR):
            delattr(node, SHARED_REPAIR_ATTR)   # another state: a repair may be asked for it
        prov = provenance_of(node) or NodeProvenance()
        set_provenance(node, NodeProvenance(prov.kv, state_bound))
        record_stored_bound("state", state_bound)

    @staticmethod
    def on_split(new_parent: Any, child: Any) -> None:
        """After SGLang's split: each half keeps its own tokens' bounds and answer mark; the state
        (at the child's end) its bound. May mutate: both nodes' provenance and answer marks."""
        prov = provenance_of(child)
        if prov is not None:
            head, rest = prov.split(len(new_parent.key))
            set_provenance(new_parent, head)
            set_provenance(child, rest)
        mark = answer_from(child)
        if mark is not None:
            if mark < len(new_parent.key):
                setattr(new_parent, ANSWER_FROM_ATTR, mark)
                setattr(child, ANSWER_FROM_ATTR, 0)
            else:
                setattr(child, ANSWER_FROM_ATTR, mark - len(new_parent.key))

    def on_overlap(self, node, prefix_len, total_prefix_len, value_slice, params, cache_actions, consumed: int) -> int:
        """After SGLang's overlap step (which reported `consumed` duplicate slots): fresh KV of a
        smaller bound replaces an approximate node's: the node takes the request's slots and its
        own are freed, where no request holds the node (else the request reads the node's KV from
        now on, and carries its taint). Only over a node wholly past what the request already
        shares with the tree. Returns the duplicate count SGLang frees. May mutate: the node's KV
        value and provenance, `cache_actions` (the node's old slots freed), the inserting request's
        floor."""
        prov = provenance_of(node)
        inserting = self.inserting()
        record = inserting.record
        if prov is None or prov.kv is None or params.prev_prefix_len > total_prefix_len \
                or total_prefix_len < computed_from(record):
            return consumed
        ours = inserting.bounds(total_prefix_len, total_prefix_len + prefix_len)
        if not bool((ours < prov.kv[:prefix_len]).any()) or float(ours.max()) > prov.kv_max():
            return consumed
        full = node.component_data[ComponentType.FULL]
        if full.lock_ref > 0 or self.tree_core.enable_hicache or prefix_len != len(node.key):
            if record is not None:
                record.acc.floor = max(record.acc.floor, provenance.TAINT)
            return consumed
        cache_actions.append(FreeDeviceKV([full.value]))
        full.value = value_slice.clone()
        set_provenance(node, NodeProvenance(ours, prov.state))
        return 0   # the request's slots are the node's now: none of them is a duplicate


class Planned(NamedTuple):
    """A plan over a matched path: the plan, the PathState it resumes from (a checkpoint plan;
    else None or unused), the path's provenance, the node id at depth plan.matched_tokens, and
    the matched path itself (ending at or below that node)."""

    plan: ReplayPlan
    start_state: Any
    prov: PathProvenance
    last_node: Any
    path: MatchedPath


def plan_carry(plan: ReplayPlan, start_state: Any, prov: PathProvenance, kv_mode: str) -> tuple[CarryBound | None, float]:
    """(the carry, the read floor) a plan starts with: an approximate replay carries from its
    replay start L - W with bound 1 (the dropped state), a checkpoint of bound > 0 from its depth
    with its bound; reading KV of bound > 0 (or, in kv_mode "recompute", its own replayed tail's
    KV) is a TAINT floor."""
    reads = plan.matched_tokens if plan.reuses_tail_kv and kv_mode == "exact" else plan.prefix_len
    floor = prov.read_floor(reads)
    if plan.kind is HitKind.APPROXIMATE:
        if kv_mode == "recompute" and plan.replayed_tokens:
            floor = max(floor, provenance.TAINT)
        return CarryBound(plan.prefix_len, 0.0), floor
    if plan.from_checkpoint and start_state is not None and start_state.bound > 0.0:
        return CarryBound(plan.prefix_len, provenance.log_of_bound(start_state.bound)), floor
    return None, floor
