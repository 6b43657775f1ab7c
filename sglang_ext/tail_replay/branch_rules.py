"""The branch and shared-state repair rules (SGLang adapter): where a request tracks its state at a
branch point (`BranchPointTrack`, a part of `TailReplayMambaComponent`) and when a match asks for
a shared state's exact recomputation (`SharedRepairRules`, a part of `TailReplayRadixCache`; the
pure decisions are `tail_replay.repair`'s).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from typing import Any

from sglang.srt.mem_cache.unified_cache.components import ComponentType

from sglang_ext.tail_replay.provenance.bounds import PathProvenance, counts_exact
from sglang_ext.tail_replay.provenance.tree import SHARED_REPAIR_ATTR, MatchedPath, Planned, answer_from
from sglang_ext.tail_replay.repair import SHARED_REPAIR_RESEND_S, branch_repair_due, shared_repair_due
from sglang_ext.tail_replay.request import TailReplayRequest


def continues_a_prompt(node: Any) -> bool:
    """Whether a path going on below `node` (which ends where a match ended) goes on with prompt
    tokens: some child's first token is not a generated answer's (`answer_from` is not 0)."""
    return any(answer_from(child) != 0 for child in node.children.values())


def branches_below(node: Any, component_type: Any) -> int:
    """How many ways the tree branches below `node` before its next state: the children of the
    first node down its single-child line that has other than one child; 1 when a state sits on
    that line first (a conversation that moved past `node`), 0 when the line ends in a leaf."""
    while len(node.children) == 1:
        node = next(iter(node.children.values()))
        if node.component_data[component_type].value is not None:
            return 1
    return len(node.children)


class BranchPointTrack:
    """SGLang's branch-point checkpoint (extra_buffer) under Tail-Replay's deeper matches (a part
    of `TailReplayMambaComponent`). Needs the tree core, the component type, SGLang's checkpoint
    grid, the cache's `request_record(req)` and `remember_matched_path(path)` (the planner's
    matched path), and `on_match(params, nodes)` (the state order's observer of a match)."""

    def __init__(self, tree_core: Any, component_type: Any, checkpoint_grid: int, *,
                 request_record: Callable[[Any], Any], remember_matched_path: Callable[[MatchedPath], None],
                 on_match: Callable[[Any, list[Any]], None]) -> None:
        self.tree_core = tree_core
        self.component_type = component_type
        self.checkpoint_grid = checkpoint_grid
        self.request_record = request_record
        self.remember_matched_path = remember_matched_path
        self.on_match = on_match

    def finalize(self, result: Any, params: Any) -> Any:
        """SGLang's branch-point checkpoint (extra_buffer): the request tracks its state at the end
        of the KV match (on the checkpoint grid) when no state sits that deep, so the next request
        that branches there resumes from a state, as on stock SGLang (whose match ends at the
        deepest state; here it runs as deep as the KV). The state is stored with the request's
        bound there (exact, or approximate). Replaces SGLang's
        `finalize_match_result_in_tree_core`; returns the match result with its
        `mamba_branching_seqlen`.

        The match counts only as deep as KV stock SGLang would still hold (`kept_by_stock`):
        a branch-point state is tracked in place of the request's own deepest state, and the
        request's insert then stops there (the extra buffer inserts up to the tracked state).
        Where the match runs into KV whose state was freed and below which no state is left
        (stock drops such a path with its last state; here state pressure keeps the KV), the
        request is not branching off anything: it tracks, and inserts, as deep as its own
        prompt, as on stock.

        The matched path is walked here, once, and handed to the cache's planner
        (`remember_matched_path`). May mutate: the planner's matched path, the state order's
        observed matches (`on_match`: the stock shadow's order)."""
        if params.req is not None and self.request_record(params.req).config.repair_kind == "shared_state":
            return result._replace(mamba_branching_seqlen=None)   # the run keeps its end state only
        path = MatchedPath.walk(self.tree_core, result.last_device_node)   # a node here, not an id
        self.remember_matched_path(path)
        self.on_match(params, path.nodes)   # stock's match of the same key (`state_order`)
        depth, state_depth = result.device_prefix_len, 0
        for node in reversed(path.nodes):
            if node.component_data[self.component_type].value is not None:
                state_depth = depth
                break
            depth -= len(node.key)
        grid = self.checkpoint_grid
        aligned = result.full_kv_hit_length // grid * grid
        if aligned > state_depth and not result.host_hit_length:   # only then can the part stock holds matter
            aligned = self.depth_kept_by_stock(result, path) // grid * grid
        return result._replace(mamba_branching_seqlen=aligned if aligned > state_depth else None)

    def depth_kept_by_stock(self, result: Any, path: MatchedPath) -> int:
        """How deep the match runs in KV stock SGLang would still hold: up to the deepest matched
        node `kept_by_stock` (the deepest state on the path is one). Reads only."""
        depth, below = result.device_prefix_len, None
        for node in reversed(path.nodes):
            if kept_by_stock(node, self.component_type, below):
                return depth + (result.full_kv_hit_length - result.device_prefix_len)
            below = node
            depth -= len(node.key)
        return depth


def kept_by_stock(node: Any, component_type: Any, known_stateless: Any = None) -> bool:
    """Whether stock SGLang would still hold `node`'s KV: a state (device or host) sits on it
    or somewhere below it (stock frees a leaf whole with its state, and then the KV-only
    nodes that become leaves). `known_stateless`: a child already searched. Reads only."""
    stack = [node]
    while stack:
        n = stack.pop()
        data = n.component_data[component_type]
        if data.value is not None or data.host_value is not None:
            return True
        stack.extend(c for c in n.children.values() if c is not known_stateless)
    return False


class SharedRepairRules:
    """The cache's shared-state repair asks, made at the match (`note`). Needs the SGLang cache
    (its tree core, page size, extra-buffer flag, Mamba component's checkpoint grid), the split
    of a node at a path's depth (`node_at_depth(path, depth) -> node id`, the match planner's), and
    whether the branch rule runs (`branch_rule`: a cache whose tree branches where something else
    than prompts sharing a prefix part turns it off, and runs only the rule below a shared state)."""

    def __init__(self, cache: Any, node_at_depth: Callable[[MatchedPath, int], Any], *, branch_rule: bool = True) -> None:
        self.cache = cache
        self.node_at_depth = node_at_depth
        self.branch_rule = branch_rule

    def note(self, record: TailReplayRequest, planned: Planned, prompt_len: int) -> None:
        """Shared-state repair (tail_replay/repair.py); asks at most once per request (an ask made
        at an earlier match of the same request, one that waited for room, stands until it is
        sent with the request's first output, `patches/tail_replay/meta.py`). Two rules:

        - at the branch (`branch_repair_due`): under the extra buffer (stock SGLang keeps a state
          where a request branches off the tree), a request whose plan is approximate and whose
          match ends where the tree goes on and its prompt goes on differently asks for the exact
          state at the checkpoint-grid depth below its match (`branch_depth`), where stock
          SGLang's miss would have kept it, so that the next conversation that branches there
          resumes exactly, as on stock.
        - below a shared approximate state (`shared_repair_due`): when the matched path's deepest
          state does not count as exact and conversations branch from it (the tree branches below
          its node before any other state, `branches_below`), the request asks for its repair.
          The repair run's exact state lands at its end, or under the extra buffer on the
          checkpoint grid below it.

        Once an exact state sits as deep as a repair's would land, nothing is asked. Once per
        node: the node the state lands on is marked when asked, and asked again only after
        `SHARED_REPAIR_RESEND_S` (if the repair never landed); a state stored on the node clears
        the mark (`commit_insert_component_data`). The branch point, where stock's miss keeps its
        state, is kept on the record whether or not a repair is asked (`stock_branch_depth`). May
        mutate: the record's `shared_repair`, `repair_asked_at` and `stock_branch_depth`, a node's mark, the tree's
        node boundaries (the node at the branch rule's depth is split off, so that the mark sits
        where the state will land)."""
        core = self.cache.tree_core
        branch = self.branch_depth(record, planned, prompt_len) if self.branch_rule else None
        if branch is not None:
            record.stock_branch_depth = branch
        if record.shared_repair is not None:
            return
        due = branch is not None and branch_repair_due(record.config, approximate=True, branches_here=True,
                                                       keeps_branch_states=True)
        depth = branch if due else None
        if depth is not None:
            node = core.node_by_id(self.node_at_depth(planned.path, depth))
        else:
            prov = planned.prov
            if not prov.states:
                return
            deepest = prov.states[0]
            if counts_exact(deepest.bound, record.config.server.exact_threshold):
                return   # an exact state is never repaired (most hits end here: no tree walk)
            node = core.node_by_id(deepest.node_id)
            if not shared_repair_due(record.config, bound=deepest.bound,
                                     branches=branches_below(node, ComponentType.MAMBA)):
                return
            grid = self.repair_grid()
            lands = deepest.depth // grid * grid
            if lands == 0 or self._exact_state_as_deep(record, prov, lands):
                return   # nothing to land, or it has landed: an exact state as deep as a repair's would be
            depth = deepest.depth
        now = time.monotonic()
        if now - getattr(node, SHARED_REPAIR_ATTR, -math.inf) < SHARED_REPAIR_RESEND_S:
            return
        setattr(node, SHARED_REPAIR_ATTR, now)
        record.shared_repair = record.repair_asked_at = depth

    def repair_grid(self) -> int:
        """Where a repair run's state lands below its end: the extra buffer's checkpoint grid (its
        end state without the extra buffer)."""
        cache = self.cache
        return cache.components[ComponentType.MAMBA].mamba_checkpoint_grid if cache.enable_mamba_extra_buffer else 1

    @staticmethod
    def _exact_state_as_deep(record: TailReplayRequest, prov: PathProvenance, depth: int) -> bool:
        exact = prov.deepest_exact_state(record.config.server.exact_threshold, strict=False)
        return exact is not None and exact.depth >= depth

    def branch_depth(self, record: TailReplayRequest, planned: Planned, prompt_len: int) -> int | None:
        """The branch rule of `note`: the depth of the exact state stock's miss keeps
        at this request's branch point and a repair would ask for (the match's end on the
        checkpoint grid), or None (the config's `repair_shared` decides the ask, not this). Only
        where the repair run keeps a state there (the extra buffer, on a server that keeps
        checkpoints). The tree branches at the
        match's end when the matched path goes on past it (SGLang's match splits the node it ends
        in, so the last matched node has children) and so does the request's prompt (its match did
        not stop at the end of what SGLang matches: the prompt but its last token, in whole
        pages), and a path going on past it is another request's prompt (`continues_a_prompt`):
        where every path going on is an earlier request's generated answer, the request is that
        conversation's next turn (or a retry), which branches off its own history, not off a
        prefix that conversations share (its own states are `repair: true`'s). Reads only."""
        plan = planned.plan
        matched, approximate = plan.matched_tokens, not plan.state_is_exact
        # the children are scanned last, and only for an approximate plan (this runs at every match)
        cache = self.cache
        branches_here = (approximate and 0 < matched < (prompt_len - 1) // cache.page_size * cache.page_size
                         and continues_a_prompt(cache.tree_core.node_by_id(planned.last_node)))
        keeps = cache.enable_mamba_extra_buffer and cache.tail_replay_config.knobs.keep_checkpoints
        if not (approximate and branches_here and keeps):
            return None
        grid = self.repair_grid()
        depth = matched // grid * grid
        if depth == 0 or self._exact_state_as_deep(record, planned.prov, depth):
            return None
        return depth
