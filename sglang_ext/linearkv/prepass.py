"""SGLang adapter: EPIC's pre-pass, the chunk heads of assembled LinearKV requests recomputed in
context before their question's forward (selector `epic-k`; the layout is the pure core's
`ChunkPlan.heads`, the admission that fills it `assembly.ChunkAssembly` at the load).

Why forwards of their own: the recomputed set `heads_1 .. heads_K, Q` is not contiguous, and a head
must see every earlier chunk (cached KV) but not its own chunk's body, so no one extend of the
request can hold it. Each head is an ordinary extend of the request's own row instead:
prefix [0, c_j) (the assembled KV, earlier heads already recomputed), extend [c_j, c_j + k), its
fresh KV written over the relocated copy in the request's own slots, its linear layers started from
the state rule's seed for a span after chunks[:j-1] (the reference path's per-span reading I2,
`sglang_ext.linearkv.initializers`), the seed written into the request's own state slot and the
span's end state discarded. Stage j runs the j-th head of every such request in the batch as one
extend forward (`runner.forward`, as SGLang's `encoder_swa_replay.run_encoder_swa_replay` does),
so a head sees the earlier heads' fresh KV at every layer and attention stays causal by true
position. Then the question's seed is (re)written (the deferred copy-on-write / clear of the
batch does it for `predecessor` / `zero`; `compose` is written here) and the scheduled forward runs
as usual.

Runs in the worker, on the forward stream, before the scheduled extend
(`patches/linearkv/prepass.py` wraps `TpModelWorker.forward_batch_generation`); every slot it reads
was resolved at admission. The source nodes stay locked until the request's first forward has run
(the pre-pass and the question's deferred copy-on-write read them): after it is launched, each such
request gets a marker (its record's `reads_done`: a device event on CUDA, True on the synchronous CPU
path), and the cache unlocks at the request's next checkpoint or release once the marker is
reached (`LinearKVRadixCache.release_read_locks`), so held chunk states do not starve the state
pool while the request decodes.
K stages cost K small forwards (one forward with a temporary request row and state slot per head
would cost one; not done).
"""

from __future__ import annotations

from copy import copy
from dataclasses import dataclass
from typing import Any

import torch

from sglang_ext.linearkv.ops import compose
from sglang_ext.linearkv.serving import record_of


@dataclass(frozen=True)
class StateSeed:
    """A linear-state seed for one span: zero, a copy of one state slot, or the composition of
    several (Mamba-2: h <- a_j h + s_j from zero through their per-layer decays; conv window of the
    last). Slots are the pool's ids as the tree holds them."""

    kind: str                                        # zero | copy | compose
    slots: tuple[torch.Tensor, ...] = ()
    decays: tuple[dict, ...] = ()


@dataclass
class PrePass:
    """An assembled request's pending head spans, each with its seed, and the question's seed to
    write after them (None: the batch's deferred copy-on-write or clear writes it)."""

    heads: list[tuple[int, int, StateSeed]]
    question: StateSeed | None = None


def pending(req: Any) -> PrePass | None:
    record = record_of(req)
    return None if record is None else record.prepass


def compose_states(mamba_pool: Any, dst: torch.Tensor, src: torch.Tensor, decays: list[dict]) -> None:
    """Write into state slot `dst` (physical ids), per Mamba-2 layer, the states of slots `src`
    folded through their decays (fp32), and the last source's conv window."""
    cache = mamba_pool.mamba_cache
    for index, layer_id in enumerate(mamba_pool.mamba_layer_ids):
        states = cache.temporal[index].index_select(0, src)
        steps = [d[layer_id] for d in decays]
        cache.temporal[index, dst] = compose("mamba2", list(states), steps).to(cache.temporal.dtype)[None]
    for conv in cache.conv:
        conv[:, dst] = conv[:, src[-1:]]


def write_seed(pool: Any, seed: StateSeed, dst: Any) -> None:
    """Seed state slot `dst` (HybridReqToTokenPool ids) on the forward stream."""
    dst_ids = pool.translate_mamba_indices(torch.as_tensor(dst).reshape(-1).to(torch.int64))
    if seed.kind == "zero":
        pool.mamba_pool.clear_slots(dst_ids)
        return
    src = pool.translate_mamba_indices(torch.cat([torch.as_tensor(s).reshape(-1) for s in seed.slots]).to(torch.int64))
    if seed.kind == "copy":
        pool.copy_mamba_state(src, dst_ids)
    else:
        compose_states(pool.mamba_pool, dst_ids, src, list(seed.decays))


def first_forward_readers(batch: Any) -> list[Any]:
    """The batch's assembled requests at their first forward over the question that hold locks
    on nodes whose states this forward reads."""
    if batch is None or not batch.forward_mode.is_extend_without_speculative():
        return []
    return [req for i, req in enumerate(batch.reqs)
            if (r := record_of(req)) is not None and r.locks and _at_question(batch, i, req)]


def mark_reads_done(runner: Any, reqs: list[Any]) -> None:
    """After the forward is launched: mark the requests' reads as enqueued (an event on the
    current stream of an accelerator, e.g. the forward stream on CUDA; True on the CPU, where the
    forward has run by now)."""
    if not reqs:
        return
    marker: Any = True
    device = torch.device(runner.device)
    if device.type != "cpu":
        marker = torch.get_device_module(device).Event()
        marker.record()
    for req in reqs:
        record_of(req).reads_done = marker


def reads_done(req: Any) -> bool:
    """Whether the request's first forward has read its seeds (waits for a pending device event)."""
    record = record_of(req)
    marker = None if record is None else record.reads_done
    if marker is None:
        return False
    if marker is not True:
        marker.synchronize()
    return True


def run_prepass(worker: Any, batch: Any) -> int:
    """Run the pending head spans of the batch's assembled requests (one extend forward per head
    index), then write their questions' seeds; the number of forwards run."""
    if batch is None or not batch.forward_mode.is_extend_without_speculative():
        return 0
    rows = [(i, req, pending(req)) for i, req in enumerate(batch.reqs) if pending(req) is not None]
    rows = [(i, req, p) for i, req, p in rows if _at_question(batch, i, req)]
    if not rows:
        return 0
    runner = worker.model_runner
    pool = runner.req_to_token_pool
    stages = max(len(p.heads) for _, _, p in rows)
    for j in range(stages):
        entries = [(i, req, p.heads[j]) for i, req, p in rows if j < len(p.heads)]
        for _, req, (_, _, seed) in entries:
            write_seed(pool, seed, req.kv.mamba_pool_idx)
        _forward(runner, _stage_batch(batch, runner, [(i, req, s, e) for i, req, (s, e, _) in entries]))
    for _, req, p in rows:
        if p.question is not None:
            write_seed(pool, p.question, req.kv.mamba_pool_idx)
        record_of(req).prepass = None
    from sglang_ext.linearkv.metrics import record_prepass

    record_prepass(stages, sum(len(p.heads) for _, _, p in rows))
    return stages


def _at_question(batch: Any, i: int, req: Any) -> bool:
    """Whether this forward is the request's first over its question (its prefix ends where its
    own forward starts: the question, or a replayed tail before it): the heads run once, before it."""
    record = record_of(req)
    return record is not None and record.plan is not None and batch.prefix_lens[i] == record.plan.forward_start


def _forward(runner: Any, stage: Any) -> None:
    from sglang.srt.model_executor.forward_batch_info import CaptureHiddenMode, ForwardBatch

    fb = ForwardBatch.init_new(stage, runner, capture_hidden_mode=CaptureHiddenMode.NULL,
                               return_hidden_states_before_norm=False)
    runner.forward(fb)


def _stage_batch(batch: Any, runner: Any, entries: list[tuple[int, Any, int, int]]) -> Any:
    """A prefill-only extend batch of the given (row in batch, req, start, end) spans, each over
    its request's own row with prefix [0, start); a shallow copy of `batch` with every
    per-request field replaced and every field this forward must not act on cleared."""
    from sglang.srt.model_executor.forward_batch_info import ForwardMode

    idx = [i for i, _, _, _ in entries]
    starts = [s for _, _, s, _ in entries]
    ends = [e for _, _, _, e in entries]
    lens = [e - s for s, e in zip(starts, ends)]
    reqs = [req for _, req, _, _ in entries]
    device = runner.device
    slots_cpu = batch.req_pool_indices_cpu[idx] if batch.req_pool_indices_cpu is not None else None
    slots = batch.req_pool_indices[torch.tensor(idx, device=batch.req_pool_indices.device)]
    req_to_token = runner.req_to_token_pool.req_to_token
    ids = [t for req, s, e in zip(reqs, starts, ends) for t in req.origin_input_ids[s:e]]

    stage = copy(batch)
    stage.forward_mode = ForwardMode.EXTEND
    stage.reqs = reqs
    stage.decoding_reqs = None
    stage.input_ids = torch.tensor(ids, dtype=torch.int64, device=device)
    stage.prefill_input_ids_cpu = None
    stage.input_embeds = stage.replace_embeds = stage.replace_positions = None
    stage.req_pool_indices = slots
    stage.req_pool_indices_cpu = slots_cpu
    stage.prefix_lens = starts
    stage.extend_lens = lens
    stage.extend_num_tokens = sum(lens)
    stage.seq_lens = torch.tensor(ends, dtype=torch.int64, device=device)
    stage.seq_lens_cpu = torch.tensor(ends, dtype=torch.int64)
    stage.seq_lens_sum = sum(ends)
    stage.orig_seq_lens = stage.seq_lens
    if hasattr(stage, "max_seq_len_host"):
        stage.max_seq_len_host = max(ends)
    stage.out_cache_loc = torch.cat([req_to_token[slots[k], s:e] for k, (s, e) in enumerate(zip(starts, ends))]).long()
    stage.out_cache_loc_dsv4 = None
    stage.return_logprob = False
    stage.top_logprobs_nums = None
    stage.token_ids_logprobs = None
    stage.extend_logprob_start_lens = lens
    stage.extend_input_logprob_token_ids = None
    stage.is_prefill_only = True
    stage.spec_info = None
    stage.sampling_info = None
    stage.has_grammar = False
    stage.multimodal_inputs = [None] * len(reqs)
    stage.encoder_lens = stage.encoder_lens_cpu = stage.encoder_out_cache_loc = None
    stage.encoder_cached = None
    stage.engram_history = stage.engram_staged_rows = None
    stage.tbo_split_seq_index = None
    stage.global_num_tokens = stage.global_num_tokens_for_logprob = None
    stage.mamba_track_indices = stage.mamba_track_mask = stage.mamba_track_seqlens = None
    stage.mamba_prefill_track_mask_cpu = stage.mamba_track_seqlens_cpu = None
    stage.mamba_cow_src_indices = stage.mamba_cow_dst_indices = stage.mamba_clear_indices = None
    return stage
