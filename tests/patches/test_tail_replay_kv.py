"""Exact-KV Tail-Replay's two seams, without a server: which rows of a packed extend batch are a
replayed tail and which tree slots they take (`patches/tail_replay/batch.py`), and the substitution
of the cached K/V into those rows (`patches/tail_replay/attention.py`), in SGLang's plain path and
inside SGLang's own breakable prefill CUDA graph capture / replay (`BreakableCUDAGraphCapture`,
driven on CPU with a stand-in for `torch.cuda.CUDAGraph` whose segments do nothing: the eager
breaks between them are SGLang's code, and are what runs at replay).
"""

from __future__ import annotations

import copy
import os
from types import SimpleNamespace

os.environ.setdefault("SGLANG_USE_CPU_ENGINE", "1")

from sglang_ext import patches  # noqa: E402

patches.apply_patches("cpu")  # before any SGLang import

import pytest  # noqa: E402
import torch  # noqa: E402
from sglang.srt.layers.radix_attention import RadixAttention  # noqa: E402
from sglang.srt.model_executor.forward_batch_info import ForwardBatch, ForwardMode  # noqa: E402
from sglang.srt.model_executor.forward_context import ForwardContext, forward_context  # noqa: E402
from sglang.srt.model_executor.runner_backend_utils.breakable_cuda_graph import (  # noqa: E402
    breakable_cuda_graph as bcg,
)
from sglang.srt.model_executor.runner_backend_utils.breakable_cuda_graph import (  # noqa: E402
    eager_on_graph,
    enable_breakable_cuda_graph,
)
from sglang.srt.model_executor.runner_utils.forward_batch import set_forward_batch  # noqa: E402
from sglang.srt.model_executor.runner_utils.prefill_graph import prefill_graph_scope  # noqa: E402

from sglang_ext.patches.tail_replay import attention as tail_replay_attention  # noqa: E402
from sglang_ext.patches.tail_replay import batch as tail_replay_batch  # noqa: E402
from sglang_ext.patches.tail_replay import prefill_graph as tail_replay_prefill_graph  # noqa: E402
from sglang_ext.patches.tail_replay.attention import MARK, substitute_cached_kv  # noqa: E402
from sglang_ext.patches.tail_replay.batch import _tail_rows_and_slots, tail_of  # noqa: E402
from sglang_ext.tail_replay import (  # noqa: E402
    RECORD_ATTR,
    HitKind,
    ReplayPlan,
    TailReplayConfig,
    TailReplayRequest,
    record_of,
)

HEADS, DIM, POOL = 2, 4, 64


class FakePool:
    """The two KV-pool accessors the substitution reads, per layer, with distinct values."""

    def __init__(self, layers=(0, 3), seed=0):
        gen = torch.Generator().manual_seed(seed)
        self.k = {i: torch.randn(POOL, HEADS, DIM, generator=gen) for i in layers}
        self.v = {i: torch.randn(POOL, HEADS, DIM, generator=gen) for i in layers}

    def get_key_buffer(self, layer_id):
        return self.k[layer_id]

    def get_value_buffer(self, layer_id):
        return self.v[layer_id]


def req(plan=None, slots=None):
    """A request whose Tail-Replay record holds `plan` and the tail's tree slots `slots`."""
    record = TailReplayRequest(config=TailReplayConfig())
    record.set_plan(plan, kv_slots=slots)
    return SimpleNamespace(**{RECORD_ATTR: record})


def approx(start, matched, first_slot):
    """An approximate plan replaying [start, matched) whose tree slots are first_slot, first_slot+1, ..."""
    plan = ReplayPlan(HitKind.APPROXIMATE, matched, start, start)
    return req(plan, torch.arange(first_slot, first_slot + matched - start))


def reference_rows(reqs, prefix_lens, extend_lens):
    """Token by token: (packed row, tree slot) of every token inside a tail that has tree slots."""
    out, row = [], 0
    for r, prefix, extend in zip(reqs, prefix_lens, extend_lens):
        for pos in range(prefix, prefix + extend):
            plan, slots = record_of(r).plan, record_of(r).kv_slots
            if plan is not None and slots is not None and plan.replay_start <= pos < plan.matched_tokens:
                out.append((row, int(slots[pos - plan.replay_start])))
            row += 1
    return out


# A packed batch: no plan; a whole tail then new tokens; a plan without tree slots (recompute /
# exact checkpoint); a chunk that starts inside a tail and ends after it; a chunk that starts and
# ends inside a tail; a chunk that starts after its tail; a one-token chunk on a tail's last token.
PACKED = [
    (req(), 0, 5),
    (approx(8, 20, 30), 8, 16),
    (req(ReplayPlan(HitKind.APPROXIMATE, 20, 8, 8), None), 8, 16),
    (approx(4, 12, 1), 8, 8),
    (approx(16, 40, 40), 20, 6),
    (approx(4, 12, 50), 12, 3),
    (approx(4, 12, 20), 11, 1),
]


def test_tail_rows_and_slots_match_a_token_by_token_reference():
    reqs, prefix, extend = map(list, zip(*PACKED))
    rows, slots = _tail_rows_and_slots(reqs, prefix, extend)
    expected = reference_rows(reqs, prefix, extend)
    assert list(zip(rows.tolist(), slots.tolist())) == expected
    # spot checks, by hand: request 2 (rows 5..20) has tail rows 5..16 -> slots 30..41;
    # request 4 (rows 37..44) starts at position 8 of the tail [4, 12): rows 37..40 -> slots 5..8
    assert expected[:12] == [(5 + i, 30 + i) for i in range(12)]
    assert expected[12:16] == [(37 + i, 5 + i) for i in range(4)]
    assert expected[16:22] == [(45 + i, 44 + i) for i in range(6)]
    assert expected[22:] == [(54, 27)]
    assert len(expected) == 23


@pytest.mark.parametrize("prefix,extend", [(0, 5), (12, 9), (20, 3)])
def test_tail_rows_and_slots_none_when_no_row_is_in_a_tail(prefix, extend):
    # a chunk before a plan's replay start cannot happen (the request starts at replay_start),
    # so: no plan, a chunk at / after the tail's end
    reqs = [req(), approx(4, 12, 1)]
    assert _tail_rows_and_slots(reqs, [0, prefix if prefix >= 12 else 12], [extend, 2]) == (None, None)


def test_chunks_of_one_tail_take_consecutive_slots():
    r = approx(8, 40, 100)
    got = []
    for start in range(8, 48, 7):   # chunks of 7 tokens cut the tail at 15, 22, 29, 36
        rows, slots = _tail_rows_and_slots([r], [start], [7])
        if rows is not None:
            assert rows.tolist() == list(range(len(rows)))
            got += slots.tolist()
    assert got == list(range(100, 132))


def test_substitute_cached_kv_overwrites_exactly_the_tail_rows():
    pool, layer = FakePool(), SimpleNamespace(layer_id=3)
    gen = torch.Generator().manual_seed(1)
    k, v = torch.randn(12, HEADS, DIM, generator=gen), torch.randn(12, HEADS, DIM, generator=gen)
    k0, v0 = k.clone(), v.clone()
    rows, slots = torch.tensor([2, 3, 4, 9]), torch.tensor([7, 8, 60, 0])
    substitute_cached_kv(layer, k, v, rows, slots, pool)
    assert torch.equal(k[rows], pool.k[3][slots]) and torch.equal(v[rows], pool.v[3][slots])
    keep = torch.tensor([i for i in range(12) if i not in rows.tolist()])
    assert torch.equal(k[keep], k0[keep]) and torch.equal(v[keep], v0[keep])
    assert not torch.equal(k[rows], k0[rows])   # the inputs differed there


def test_substitute_cached_kv_casts_to_the_model_dtype_and_refuses_fp8():
    pool, layer = FakePool(), SimpleNamespace(layer_id=0)
    k, v = torch.zeros(4, HEADS, DIM, dtype=torch.bfloat16), torch.zeros(4, HEADS, DIM, dtype=torch.bfloat16)
    substitute_cached_kv(layer, k, v, torch.tensor([1]), torch.tensor([5]), pool)
    assert torch.equal(k[1], pool.k[0][5].to(torch.bfloat16))
    pool.k[0] = pool.k[0].to(torch.float8_e4m3fn)
    with pytest.raises(NotImplementedError, match="recompute"):
        substitute_cached_kv(layer, k, v, torch.tensor([1]), torch.tensor([5]), pool)


def test_on_a_translating_pool_the_tail_reads_the_physical_slots():
    """`--enable-unified-memory`: the tree's slot ids are virtual and the pool's allocator
    translates them (`translate_kv_loc`, read at each use: compaction moves pages between
    iterations); the tail's cached K/V is read at the translated slots, not at the tree's ids."""
    pool, layer = FakePool(), SimpleNamespace(layer_id=3)
    pages = POOL // 8   # virtual page p -> physical page pages - 1 - p (pages of 8 slots)

    def physical(i: int) -> int:
        return (pages - 1 - i // 8) * 8 + i % 8

    def translate(ids: torch.Tensor) -> torch.Tensor:
        return torch.tensor([physical(i) for i in ids.tolist()])

    runner = SimpleNamespace(kv_index_translator=SimpleNamespace(is_translating=True),
                             token_to_kv_pool_allocator=SimpleNamespace(translate_kv_loc=translate))
    assert tail_replay_batch.translation_of(runner) is translate
    assert tail_replay_batch.translation_of(SimpleNamespace(kv_index_translator=SimpleNamespace(is_translating=False))) is None
    assert tail_replay_batch.translation_of(SimpleNamespace()) is None
    with pytest.raises(NotImplementedError, match="recompute"):
        tail_replay_batch.translation_of(SimpleNamespace(kv_index_translator=SimpleNamespace(is_translating=True),
                                                         token_to_kv_pool_allocator=SimpleNamespace()))
    fb = make_batch([5, 16, 8], [0, 8, 8])
    rows, slots = _tail_rows_and_slots(BATCH_REQS, fb.extend_prefix_lens_cpu, fb.extend_seq_lens_cpu)
    tail_replay_batch._remember(tail_replay_batch._batch_keys(fb), rows, slots, pool, translate=translate)
    got_rows, got_slots, got_pool = tail_of(fb)
    assert torch.equal(got_rows, rows) and got_pool is pool
    assert got_slots.tolist() == [physical(i) for i in slots.tolist()] != slots.tolist()
    k, v = torch.zeros(29, HEADS, DIM), torch.zeros(29, HEADS, DIM)
    substitute_cached_kv(layer, k, v, got_rows, got_slots, pool)
    assert torch.equal(k[rows], pool.k[3][got_slots]) and not torch.equal(k[rows], pool.k[3][slots])


# ------------------------------------------------------------ RadixAttention, both paths


class RecordingBackend:
    """Attention backend stand-in: records the K/V it is handed and returns q."""

    def __init__(self):
        self.seen = []

    def forward(self, q, k, v, layer, forward_batch, save_kv_cache=True, **kwargs):
        self.seen.append((k.clone(), v.clone()))
        return q.clone()


def make_batch(extend_lens, prefix_lens):
    n = sum(extend_lens)
    return ForwardBatch(
        forward_mode=ForwardMode.EXTEND, batch_size=len(extend_lens), input_ids=torch.zeros(n, dtype=torch.int64),
        req_pool_indices=torch.arange(len(extend_lens)), seq_lens=torch.tensor([p + e for p, e in zip(prefix_lens, extend_lens)]),
        out_cache_loc=torch.arange(n), seq_lens_sum=sum(prefix_lens) + n, positions=torch.arange(n),
        extend_seq_lens=torch.tensor(extend_lens), extend_seq_lens_cpu=list(extend_lens),
        extend_prefix_lens=torch.tensor(prefix_lens), extend_prefix_lens_cpu=list(prefix_lens),
        global_num_token_non_padded_cpu=n)


def register_tails(fb, reqs, pool):
    """What the ForwardBatch.init_new patch does for a batch (without a model runner)."""
    rows, slots = _tail_rows_and_slots(reqs, fb.extend_prefix_lens_cpu, fb.extend_seq_lens_cpu)
    tail_replay_batch._remember(tail_replay_batch._batch_keys(fb), rows, slots, pool)
    return rows, slots


def qkv(n, seed):
    gen = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(n, HEADS * DIM, generator=gen) for _ in range(3))


LAYER = RadixAttention(num_heads=HEADS, head_dim=DIM, scaling=1.0, num_kv_heads=HEADS, layer_id=3)
BATCH_REQS = [req(), approx(8, 20, 30), approx(4, 12, 1)]   # extends 5, 16, 8 from 0, 8, 8


def assert_tail_is_cached(seen_k, seen_v, k_in, v_in, rows, slots, pool):
    k_in, v_in = k_in.view(-1, HEADS, DIM), v_in.view(-1, HEADS, DIM)
    assert torch.equal(seen_k[rows], pool.k[3][slots]) and torch.equal(seen_v[rows], pool.v[3][slots])
    keep = torch.tensor([i for i in range(len(k_in)) if i not in set(rows.tolist())])
    assert torch.equal(seen_k[keep], k_in[keep]) and torch.equal(seen_v[keep], v_in[keep])


def test_plain_forward_substitutes_before_the_backend_also_on_a_batch_copy():
    pool, backend = FakePool(), RecordingBackend()
    fb = make_batch([5, 16, 8], [0, 8, 8])
    rows, slots = register_tails(fb, BATCH_REQS, pool)
    q, k, v = qkv(29, seed=2)
    k_in, v_in = k.clone(), v.clone()
    runner_copy = copy.copy(fb)   # SGLang's runners run the model on copies of the batch
    with forward_context(ForwardContext(attn_backend=backend), forward_batch=runner_copy):
        LAYER.forward(q, k, v, runner_copy)
    (seen_k, seen_v), = backend.seen
    assert_tail_is_cached(seen_k, seen_v, k_in, v_in, rows, slots, pool)


def test_plain_forward_leaves_batches_without_tails_alone():
    backend = RecordingBackend()
    fb = make_batch([5, 16], [0, 0])
    q, k, v = qkv(21, seed=3)
    with forward_context(ForwardContext(attn_backend=backend), forward_batch=fb):
        LAYER.forward(q, k.clone(), v.clone(), fb)
    (seen_k, _), = backend.seen
    assert torch.equal(seen_k, k.view(-1, HEADS, DIM))


def test_the_installed_eager_attention_is_sglangs_eager_callable_around_the_substitution():
    """What replay calls is the decorator's `__wrapped__` body (its closure `captured_inner`):
    that body must be the substituting one, and around SGLang's own body."""
    installed = RadixAttention.__dict__["_eager_attention"]
    assert isinstance(installed, bcg._EagerOnGraphCallable)
    body = installed.__wrapped__
    assert getattr(body, MARK, False)
    assert installed._eager_call is body
    sglang_body = body.__wrapped__
    assert sglang_body.__qualname__ == "RadixAttention._eager_attention"
    assert "get_forward_batch" in sglang_body.__code__.co_names   # SGLang's body, not ours
    tail_replay_attention.apply()   # idempotent: still one layer of substitution
    assert RadixAttention.__dict__["_eager_attention"].__wrapped__.__wrapped__ is sglang_body


class FakeCUDAGraph:
    """Stand-in for torch.cuda.CUDAGraph: a segment that captures and replays nothing."""

    instances = 0

    def __init__(self, *args, **kwargs):
        FakeCUDAGraph.instances += 1

    def capture_begin(self, *args, **kwargs):
        pass

    def capture_end(self):
        pass

    def replay(self):
        pass


@pytest.fixture
def fake_cuda_graph(monkeypatch):
    monkeypatch.setattr(torch.cuda, "CUDAGraph", FakeCUDAGraph)
    monkeypatch.setattr(bcg, "_is_stream_capturing", lambda stream: False)


def capture_and_replay(layer, pool, replay_reqs, *, capture_bs=(29,), replay_extends, replay_prefixes):
    """Capture one breakable graph of `layer.forward` on a dummy batch (no tails, as SGLang's
    capture batches), then replay it for a real batch with tails, the way the prefill runner does:
    the static q/k/v buffers receive the replayed batch's values (what the previous segment would
    write), the batch is published with set_forward_batch, and the graph replays."""
    backend = RecordingBackend()
    n = sum(capture_bs)
    static_q, static_k, static_v = (torch.zeros(n, HEADS * DIM) for _ in range(3))
    capture_batch = make_batch(list(capture_bs), [0] * len(capture_bs))
    graph = bcg.BreakableCUDAGraph()
    ctx = ForwardContext(attn_backend=backend)
    with enable_breakable_cuda_graph(), prefill_graph_scope(full_graph=False), \
            set_forward_batch(capture_batch), forward_context(ctx, forward_batch=capture_batch):
        with bcg.BreakableCUDAGraphCapture(cuda_graph=graph):
            layer.forward(static_q, static_k, static_v, capture_batch)
    assert len(graph._break_fns) == 1 and len(graph._segments) == 2   # one eager break: attention
    backend.seen.clear()

    replay_batch = make_batch(replay_extends, replay_prefixes)
    rows, slots = register_tails(replay_batch, replay_reqs, pool)
    q, k, v = qkv(n, seed=4)
    static_q.copy_(q), static_k.copy_(k), static_v.copy_(v)
    with enable_breakable_cuda_graph(), prefill_graph_scope(full_graph=False, raw_num_tokens=n), \
            set_forward_batch(replay_batch), forward_context(ctx, forward_batch=replay_batch):
        graph.replay()
    return backend, rows, slots, k, v


def test_breakable_graph_replay_runs_the_substitution_in_the_eager_break(fake_cuda_graph):
    pool = FakePool()
    backend, rows, slots, k_in, v_in = capture_and_replay(
        LAYER, pool, BATCH_REQS, replay_extends=[5, 16, 8], replay_prefixes=[0, 8, 8])
    (seen_k, seen_v), = backend.seen   # replay ran the eager break once, no Python forward
    assert_tail_is_cached(seen_k, seen_v, k_in, v_in, rows, slots, pool)


def test_a_substitution_wrapped_around_the_decorated_attribute_is_lost_at_replay(fake_cuda_graph, monkeypatch):
    """The pitfall the module avoids: wrapping the decorated `_eager_attention` (or `forward`)
    runs only at capture; SGLang's replay closure calls the body it decorated."""
    installed = RadixAttention.__dict__["_eager_attention"]
    sglang_only = eager_on_graph(installed.__wrapped__.__wrapped__)

    def wrapped_outside(self, q, k, v, output, *args, **kwargs):
        from sglang.srt.model_executor.runner_utils.forward_batch import get_forward_batch
        tail_replay_attention.substitute_for_batch(self, k, v, get_forward_batch(), kwargs)
        return sglang_only.__get__(self)(q, k, v, output, *args, **kwargs)

    monkeypatch.setattr(RadixAttention, "_eager_attention", wrapped_outside)
    pool = FakePool()
    backend, rows, slots, k_in, _ = capture_and_replay(
        LAYER, pool, BATCH_REQS, replay_extends=[5, 16, 8], replay_prefixes=[0, 8, 8])
    (seen_k, _), = backend.seen
    assert torch.equal(seen_k, k_in.view(-1, HEADS, DIM))   # the tail rows were NOT substituted
    assert not torch.equal(seen_k[rows], pool.k[3][slots])


def test_forward_substitutes_nothing_while_a_prefill_graph_captures(fake_cuda_graph):
    """Inside a prefill graph scope `forward` is being captured: a substitution there would be
    baked into the segment with capture-time rows; only the eager break may substitute."""
    pool, backend = FakePool(), RecordingBackend()
    fb = make_batch([5, 16, 8], [0, 8, 8])
    register_tails(fb, BATCH_REQS, pool)
    q, k, v = qkv(29, seed=5)
    calls = []
    original = tail_replay_attention.substitute_for_batch

    def spy(layer, k_, v_, batch, kwargs):
        calls.append(batch)
        return original(layer, k_, v_, batch, kwargs)

    tail_replay_attention.substitute_for_batch = spy
    try:
        with enable_breakable_cuda_graph(), prefill_graph_scope(full_graph=False), set_forward_batch(fb), \
                forward_context(ForwardContext(attn_backend=backend), forward_batch=fb):
            with bcg.BreakableCUDAGraphCapture(cuda_graph=bcg.BreakableCUDAGraph()):
                LAYER.forward(q, k, v, fb)
    finally:
        tail_replay_attention.substitute_for_batch = original
    assert len(calls) == 1   # once: in the eager break, not in forward


# ------------------------------------------------------------ full prefill graph: eager fallback


def test_full_prefill_graph_is_skipped_for_batches_with_a_tail():
    pool = FakePool()
    with_tail, without = make_batch([5, 16, 8], [0, 8, 8]), make_batch([5, 16], [0, 0])
    register_tails(with_tail, BATCH_REQS, pool)
    wrapped = tail_replay_prefill_graph._wrap_can_run_graph(lambda self, fb: True)
    full, breakable = SimpleNamespace(_is_full_backend=True), SimpleNamespace(_is_full_backend=False)
    assert wrapped(full, with_tail) is False
    assert wrapped(full, copy.copy(with_tail)) is False
    assert wrapped(full, without) is True
    assert wrapped(breakable, with_tail) is True   # the eager break substitutes at replay


def test_prefill_graph_patch_is_installed():
    from sglang.srt.model_executor.runner.prefill_cuda_graph_runner import PrefillCudaGraphRunner

    assert getattr(PrefillCudaGraphRunner.can_run_graph, "sglang_ext_tail_replay", False)
