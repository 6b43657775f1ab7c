"""Exact-KV Tail-Replay: the replayed tail runs through the model, but every attention layer
sees the tree's exact cached K/V for it; plus Tail-Replay's metrics and `meta_info` fields.

Targets (SGLang 0.5.23):
- `srt/model_executor/forward_batch_info.py::ForwardBatch.init_new`: per extend forward, find
  the rows of the packed batch that belong to a request's replayed tail [prefix_len, L), and the
  tree's KV slots for them (`req.tail_replay_kv_slots`, set by the tail_replay cache at match);
  kept in a small registry keyed by objects that the runners' copies of the batch share.
- `srt/layers/radix_attention.py::RadixAttention.forward`: before the attention backend
  stores and reads K/V, those rows of k / v are replaced by the cached values. Because the
  substitution happens ahead of the backend, it holds for every backend (ragged or paged), and
  the tail's freshly allocated KV slots receive exact copies (freed as duplicates on insert).
- `srt/managers/scheduler_components/output_streamer.py::get_cached_tokens_details`: adds
  `meta_info["cached_tokens_details"]["tail_replay"]`.
- `srt/sampling/sampling_params.py::SamplingParams.verify`: validates a request's
  `custom_params["tail_replay"]` overrides when it arrives, so a bad one is that request's
  HTTP 400 error naming the key, never a scheduler crash.
Requests without a Tail-Replay decision are untouched.
"""

from __future__ import annotations

import functools
from collections import OrderedDict

import torch

#: tail rows/slots of recent extend batches, keyed by id() of the batch's `extend_seq_lens_cpu`
#: list and `extend_seq_lens` tensor. SGLang's model runners run the model on copies of the
#: ForwardBatch (dataclass replace / copy.copy), which drop attributes set on the original but
#: share those objects; the registry keeps them alive, so their ids are not reused meanwhile.
_TAIL_BY_BATCH: "OrderedDict[int, tuple]" = OrderedDict()
_MAX_BATCHES_IN_FLIGHT = 8

TARGET = ("srt/model_executor/forward_batch_info.py: ForwardBatch.init_new; "
          "srt/sampling/sampling_params.py: SamplingParams.verify; "
          "srt/layers/radix_attention.py: RadixAttention.forward; "
          "srt/managers/scheduler_components/output_streamer.py: get_cached_tokens_details")


def _tail_rows_and_slots(reqs, prefix_lens, extend_lens):
    """Rows of the packed extend batch inside a replayed tail, and the tree slots for them."""
    rows, slots, offset = [], [], 0
    for req, prefix, extend in zip(reqs, prefix_lens, extend_lens):
        plan, tail_slots = getattr(req, "tail_replay", None), getattr(req, "tail_replay_kv_slots", None)
        if tail_slots is not None and plan is not None:
            lo, hi = max(prefix, plan.replay_start), min(prefix + extend, plan.matched_tokens)
            if hi > lo:
                rows.append(torch.arange(offset + lo - prefix, offset + hi - prefix))
                slots.append(tail_slots[lo - plan.replay_start:hi - plan.replay_start])
        offset += extend
    if not rows:
        return None, None
    return torch.cat(rows), torch.cat(slots)


def _record_first_forward(reqs) -> None:
    from sglang_ext.tail_replay.metrics import record_plan

    for req in reqs:
        plan = getattr(req, "tail_replay", None)
        if plan is not None and not getattr(req, "tail_replay_recorded", False):
            req.tail_replay_recorded = True
            record_plan(plan)


def _wrap_init_new(original):
    @functools.wraps(original)
    def init_new(cls, batch, model_runner, **kwargs):
        fb = original.__func__(cls, batch, model_runner, **kwargs)
        if fb.forward_mode.is_extend() and not fb.forward_mode.is_target_verify():
            _record_first_forward(batch.reqs)
            prefix = fb.extend_prefix_lens_cpu or fb.extend_prefix_lens.tolist()
            extend = fb.extend_seq_lens_cpu or fb.extend_seq_lens.tolist()
            rows, slots = _tail_rows_and_slots(batch.reqs, prefix, extend)
            if rows is not None:
                _remember(_batch_keys(fb), rows.to(fb.input_ids.device), slots, model_runner.token_to_kv_pool)
        return fb

    return classmethod(init_new)


def _batch_keys(forward_batch) -> list:
    keys = (getattr(forward_batch, "extend_seq_lens_cpu", None), getattr(forward_batch, "extend_seq_lens", None))
    return [key for key in keys if key is not None]


def _remember(keys, rows, slots, kv_pool) -> None:
    for key in keys:
        _TAIL_BY_BATCH[id(key)] = (key, rows, slots, kv_pool)
    while len(_TAIL_BY_BATCH) > 2 * _MAX_BATCHES_IN_FLIGHT:
        _TAIL_BY_BATCH.popitem(last=False)


def tail_of(forward_batch):
    """(rows, slots, kv pool) of the replayed tails in this forward batch (or a copy of it), or None."""
    for key in _batch_keys(forward_batch):
        entry = _TAIL_BY_BATCH.get(id(key))
        if entry is not None and entry[0] is key:
            return entry[1:]
    return None


def substitute_cached_kv(layer, k, v, rows, slots, pool) -> None:
    """k, v: [tokens, heads, dim] (post-RoPE); overwrite the tail rows with the pool's values."""
    k_cached = pool.get_key_buffer(layer.layer_id)[slots]
    v_cached = pool.get_value_buffer(layer.layer_id)[slots]
    if k_cached.dtype != k.dtype and k_cached.element_size() < 2:
        raise NotImplementedError("exact-KV Tail-Replay needs an unquantized KV cache; "
                                  "use kv_mode 'recompute' with an fp8 KV cache")
    k[rows] = k_cached.view(-1, *k.shape[1:]).to(k.dtype)
    v[rows] = v_cached.view(-1, *v.shape[1:]).to(v.dtype)


def _wrap_attention_forward(original):
    @functools.wraps(original)
    def forward(self, q, k, v, forward_batch, *args, **kwargs):
        tail = tail_of(forward_batch) if k is not None and "k_rope" not in kwargs else None
        if tail is not None and forward_batch.forward_mode.is_extend():
            k = k.view(-1, self.tp_k_head_num, self.qk_head_dim)
            v = v.view(-1, self.tp_v_head_num, self.v_head_dim)
            substitute_cached_kv(self, k, v, *tail)
        return original(self, q, k, v, forward_batch, *args, **kwargs)

    return forward


def _wrap_cached_tokens_details(original):
    @functools.wraps(original)
    def get_cached_tokens_details(self, req):
        details = original(self, req)
        plan = getattr(req, "tail_replay", None)
        if plan is None:
            return details
        from sglang_ext.tail_replay.metrics import plan_summary

        return {**(details or {"device": req.cached_tokens, "host": 0}), "tail_replay": plan_summary(plan)}

    return get_cached_tokens_details


def _wrap_verify(original):
    @functools.wraps(original)
    def verify(self, *args, **kwargs):
        original(self, *args, **kwargs)
        from sglang_ext.env import read_tail_replay_config
        from sglang_ext.tail_replay.config import REQUEST_PARAM_KEY, with_overrides

        overrides = (self.custom_params or {}).get(REQUEST_PARAM_KEY)
        if overrides is not None:
            with_overrides(read_tail_replay_config(), overrides)

    return verify


def apply() -> None:
    from sglang.srt.layers.radix_attention import RadixAttention
    from sglang.srt.sampling.sampling_params import SamplingParams
    from sglang.srt.managers.scheduler_components.output_streamer import SchedulerOutputStreamer
    from sglang.srt.model_executor.forward_batch_info import ForwardBatch

    ForwardBatch.init_new = _wrap_init_new(ForwardBatch.__dict__["init_new"])
    RadixAttention.forward = _wrap_attention_forward(RadixAttention.forward)
    SamplingParams.verify = _wrap_verify(SamplingParams.verify)
    SchedulerOutputStreamer.get_cached_tokens_details = _wrap_cached_tokens_details(
        SchedulerOutputStreamer.get_cached_tokens_details)

