"""SGLang adapter: the admission of an assembled LinearKV request (step 3 of `sglang_cache`'s
route): the chunk nodes are locked, fresh KV slots allocated, the tree's KV of [p0, c_1) and each
chunk's KV (keys re-rotated to its offset) copied into them, the request's state slots taken and
its question's state seeded by the plan's state rule; the slots become the request's prefix
(`prefix_device_indices`). A part of `LinearKVRadixCache`, which finds the nodes
(`prefix_node`, `chunk_nodes`, `chunk_space`, `transitions_of`)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from sglang.srt.mem_cache.base_prefix_cache import EvictParams
from sglang.srt.mem_cache.unified_cache.components import ComponentType

from sglang_ext.linearkv.admission import RoundBudget, round_slots
from sglang_ext.linearkv.prepass import PrePass, StateSeed, write_seed
from sglang_ext.linearkv.serving import COMPOSING_RULES, LinearKVRequest
from sglang_ext.linearkv.serving import record_of as linearkv_record
from sglang_ext.tail_replay import KIND_ASSEMBLED, record_of


class ChunkAssembly:
    """Admission of assembled requests. Needs the LinearKV cache (its pools, tree core, locks,
    key relocator, and its chunk finders). SGLang's own hook is handed in where it runs instead
    (`stock`). May mutate: the request's record (slots, locks, seeds, counts), its state slots and
    deferred copy-on-write, the KV and state pools, node locks, `admission`."""

    def __init__(self, cache: Any) -> None:
        self.cache = cache
        #: the state slots of the admission round under way (`admission.RoundBudget`), opened by
        #: `patches/linearkv/admission.py` as SGLang's PrefillAdder starts a round
        self.admission: RoundBudget | None = None

    def open_admission_round(self, adder: Any) -> RoundBudget:
        """A round begins: its budget is SGLang's (`rem_mamba_slots`) where it keeps one, else
        SGLang's formula (free state slots plus the tree's evictable states). May mutate:
        `admission`."""
        start = adder.rem_mamba_slots
        if start is None:
            start = self.cache.req_to_token_pool.mamba_allocator.schedulable_available_size() + self.cache.mamba_evictable_size()
        self.admission = RoundBudget(adder, start)
        return self.admission

    def tracking_slots_of(self, req: Any) -> int:
        """Ping-pong track slots the request has still to take (`extra_buffer`), 0 otherwise."""
        if not self.cache.enable_mamba_extra_buffer or req.kv.mamba_ping_pong_track_buffer is not None:
            return 0
        return self.cache.req_to_token_pool.mamba_initial_tracking_slots

    def round_slots_of(self, req: Any) -> int:
        """State slots the request takes from this round's pool (`admission.round_slots`)."""
        return round_slots(req.kv.holds_mamba, getattr(req, "session", None) is not None, self.tracking_slots_of(req))

    def init_load_back(self, params: Any, stock: Callable[[Any], Any]):
        req = params.req
        record = None if req is None else linearkv_record(req)
        if record is None or record.plan is None or record.register or record.chunks_hit == 0:
            return stock(params)
        loaded = self._assemble(req, record)
        return loaded, req.last_node

    def _assemble(self, req: Any, record: LinearKVRequest) -> int:
        """Copy the KV into fresh slots and seed the question's state; the number of tokens placed
        (0: declined). The copies run on the scheduler's stream at admission; SGLang's overlap
        scheduler makes the forward stream wait on that stream before it launches the batch that
        reads them, and the source nodes stay locked until the copies are enqueued (those whose
        states a seed reads later, the deferred copy-on-write's or EPIC's pre-pass's, until the
        request's first forward has read them: `release_read_locks`)."""
        plan = record.plan
        prefix = self.cache.prefix_node(req, record)
        found = None if prefix is None else self.cache.chunk_nodes(req, record)
        if found is None:
            self._declined(req, record)
            return 0
        prefix_node, prefix_root = prefix
        nodes, prefix_state = found
        sources = [prefix_node, *nodes, *([prefix_state] if prefix_state is not None else [])]
        if plan.heads and not plan.seeds_zero:
            reads = list(range(1, len(sources)))   # the seeds of EPIC's heads read these nodes' states
        elif plan.state == "predecessor":
            reads = [len(nodes)]                   # the question's copy-on-write reads the last chunk's
        else:
            reads = []
        budgeted = self.lock_sources(req, sources, reads)
        if budgeted is None:
            self._declined(req, record)
            return 0
        locks, held = budgeted
        keep: list[int] = []   # indices of the locks held until the first forward has read the states
        try:
            p0 = record.tree_prefix_len
            total = plan.forward_start - p0
            slots = self._alloc(total)
            if slots is None:
                self._declined(req, record)
                return 0
            self._copy_prefix(prefix_node, prefix_root, p0, slots[:plan.prefix_end - p0])
            for node, (start, end) in zip(nodes, plan.chunks):
                end = min(end, plan.forward_start)   # a replayed tail is computed by the forward
                if end <= start:
                    continue
                src = self.cache.tree_core.collect_full_device_indices(node, self.cache.root_node_handle(self.cache.chunk_space(req)[0]))
                self.cache.relocator.copy(src[:end - start], slots[start - p0:end - p0], delta=start)
            if not self._seed_state(req, record, nodes, prefix_state):
                self.cache.token_to_kv_pool_allocator.free(slots)
                self._declined(req, record)
                return 0
            keep = reads
        finally:
            for i, lock in locks.items():
                if i not in keep:
                    self.cache.unlock(lock)
        if self.admission is not None:
            self.admission.debit(held)
        record.locks = [locks[i] for i in keep]
        record.reads_done = None
        record.slots = slots
        record.assembled = True
        record.reused_tokens = plan.chunk_tokens - plan.recomputed_chunk_tokens
        record.recomputed_tokens = len(req.origin_input_ids) - plan.forward_start + plan.head_tokens
        tr = record_of(req)
        if tr is not None:   # the Tail-Replay plan over P was only the fallback; the answer is not exact
            tr.drop_plan(KIND_ASSEMBLED)
        return total

    def lock_sources(self, req: Any, sources: list[Any], reads: list[int]) -> tuple[dict[int, Any], int] | None:
        """Lock every source node; ({index: lock}, the evictable states the locks on `reads` take
        out of the pool until the request's first forward), or None (nothing locked) when this
        round's state slots (`admission`) cannot cover the request's own slots and those states.
        Reads the budget; the caller debits `held` once the load succeeds. May mutate: node locks."""
        evictable = self.cache.mamba_evictable_size()
        locks = {i: self.cache.lock(sources[i]) for i in reads}
        held = evictable - self.cache.mamba_evictable_size()
        locks.update((i, self.cache.lock(node)) for i, node in enumerate(sources) if i not in locks)
        budget = self.admission   # this round's (a load runs only inside SGLang's PrefillAdder)
        if budget is not None and not budget.fits(self.round_slots_of(req) + held):
            for lock in locks.values():
                self.cache.unlock(lock)
            return None
        return locks, held

    def _declined(self, req: Any, record: LinearKVRequest) -> None:
        """The load is declined: the request runs Tail-Replay's plan over P and prefills the rest."""
        record.chunks_hit, record.chunks_missed = 0, len(record.plan.chunks)
        record.recomputed_tokens = len(req.origin_input_ids) - record.tree_prefix_len

    def _alloc(self, n: int) -> torch.Tensor | None:
        allocator = self.cache.token_to_kv_pool_allocator
        slots = allocator.alloc(n)
        if slots is None:
            self.cache.evict_for_alloc(EvictParams(num_tokens=n))
            slots = allocator.alloc(n)
        return slots

    def _copy_prefix(self, prefix_node: Any, root: Any, start: int, dst: torch.Tensor) -> None:
        """The exact KV of [start, c_1) (the part of P the tree prefix does not cover)."""
        if len(dst) == 0:
            return
        path = self.cache.tree_core.collect_full_device_indices(prefix_node, root)
        self.cache.relocator.copy(path[start:start + len(dst)], dst, delta=0)

    def _take_state_slots(self, req: Any) -> bool:
        """Take every state slot the request will hold now, at its load: its own state and, under
        `extra_buffer`, its ping-pong track slots (SGLang would take those after admission, when
        the chunk states this load locks can no longer be evicted to make room, and asserts if
        they are not there). False (nothing taken): not enough slots even after eviction."""
        pool = self.cache.req_to_token_pool
        kv = req.kv
        tracking = self.tracking_slots_of(req)
        needed = (0 if kv.holds_mamba else 1) + tracking
        allocator = pool.mamba_allocator
        if allocator.schedulable_available_size() < needed:
            self.cache.evict_for_alloc(EvictParams(num_tokens=0, mamba_num=needed - allocator.schedulable_available_size()))
        if allocator.schedulable_available_size() < needed:
            return False
        if not kv.holds_mamba:
            kv.mamba_pool_idx = allocator.alloc(1)[0]
            write_pos = pool.mamba_pool.replayssm_write_pos
            if write_pos is not None:   # a fresh slot starts an empty ring (as SGLang's alloc does)
                write_pos[kv.mamba_pool_idx] = 0
        if tracking:
            pool._alloc_ping_pong_buffer(req)
        return True

    def _seed_state(self, req: Any, record: LinearKVRequest, nodes: list[Any], prefix_state: Any) -> bool:
        """Seed the question's state slot by the plan's state rule (predecessor: a deferred
        copy-on-write of the last chunk's; zero: a deferred clear; compose: folded in now), and
        leave EPIC's heads, if any, to the worker's pre-pass (`prepass.py`), which then writes a
        composed question seed itself (its stages overwrite the slot). False (nothing changed): no
        state slot to be had, even after eviction; the load is then declined."""
        kv = req.kv
        if not self._take_state_slots(req):
            return False
        plan = record.plan
        kv.mamba_cow_src_index = None
        kv.mamba_needs_clear = False
        question = self._seed_after(req, plan, len(plan.chunks), nodes, prefix_state)
        if plan.state == "predecessor":
            kv.mamba_cow_src_index = question.slots[0]
        elif plan.seeds_zero:
            kv.mamba_needs_clear = True
        elif not plan.heads:
            write_seed(self.cache.req_to_token_pool, question, kv.mamba_pool_idx)
        record.state_source = plan.state
        if plan.heads:
            heads = [(s, e, self._seed_after(req, plan, j, nodes, prefix_state)) for j, (s, e) in enumerate(plan.heads)]
            record.prepass = PrePass(heads, question if plan.state in COMPOSING_RULES else None)
        return True

    def _seed_after(self, req: Any, plan: Any, j: int, nodes: list[Any], prefix_state: Any) -> StateSeed:
        """The state rule's seed for a span after P and chunks[:j] (the reference path's per-span
        rule, `initializers.STATE_RULES`): zero; predecessor: chunk j-1's end state (j = 0: P's,
        zero without P); compose: P's and chunks[:j]'s folded through their decays."""
        sources = ([prefix_state] if prefix_state is not None else []) + list(nodes[:j])
        if plan.seeds_zero or not sources:
            return StateSeed("zero")
        slots = tuple(self.cache.tree_core.get_component_device_value(n, ComponentType.MAMBA) for n in sources)
        if plan.state == "predecessor":
            return StateSeed("copy", slots[-1:])
        spans = ([(0, plan.prefix_end)] if plan.prefix_end else []) + list(plan.chunks[:j])
        decays = self.cache.transitions_of(req, spans)
        assert decays is not None, "linearkv: a composed chunk lost its transition after its match"
        return StateSeed("compose", slots, tuple(decays))

    def prefix_device_indices(self, req: Any, stock: Callable[[Any], torch.Tensor]) -> torch.Tensor:
        """The request's prefix slots: the tree's [0, p0), then the assembled slots (the row owns
        them from here on). May mutate: the record's `slots`."""
        record = linearkv_record(req)
        slots = None if record is None else record.slots
        if record is None or not record.assembled or slots is None:
            return stock(req)
        p0 = record.tree_prefix_len
        path = self.cache.tree_core.collect_full_device_indices(req.last_node, self.cache.root_node_handle(req.extra_key))
        out = torch.cat([path[:p0].to(torch.int64), slots.to(torch.int64)])
        assert len(out) == req.prefix_len, (req.rid, len(out), req.prefix_len)
        record.slots = None   # the row owns them from here on (freed at release)
        return out
