"""The per-request state bound without a server: which rows of a packed batch are a request's
replayed tail, the sums over prefill chunks, the factor against `hybrid_kernels.replay_bound`, and
the meta_info summary per hit kind."""

from __future__ import annotations

import pytest
import torch

from hybrid_kernels.replay_bound import gdn_replay_bound, mamba2_replay_bound
from sglang_ext.tail_replay import (
    DEFAULTS,
    HitKind,
    ReplayPlan,
    TailDecay,
    TailReplayRequest,
    bound_segments,
    gdn_log_decay,
    mamba2_log_decay,
    replay_summary,
    summarize,
)


def _run_chunks(tails, requests_tokens, chunk, layer_gates):
    """Feed a packed batch of requests chunk by chunk (SGLang's chunked prefill of each request's
    extend segment), accumulating `layer_gates[layer](rows of the batch)`."""
    done = [0] * len(requests_tokens)
    while any(d < n for d, n in zip(done, requests_tokens)):
        extend = [min(chunk, n - d) for d, n in zip(done, requests_tokens)]
        segments = bound_segments(tails, done, extend)
        batch_rows = [torch.arange(d, d + e) for d, e in zip(done, extend)]
        if segments is not None:
            for layer, gates in layer_gates.items():
                packed = torch.cat([gates[i][rows] for i, rows in enumerate(batch_rows)])
                segments.accumulate(layer, packed[segments.rows])
        done = [d + e for d, e in zip(done, extend)]


def test_segments_pick_each_requests_tail_rows_of_the_packed_batch():
    a, b = TailDecay(), TailDecay()
    # request 0: extend [90, 130) with tail [90, 100); request 1: no replay; request 2: extend [40, 60)
    # inside its tail [30, 70)
    segments = bound_segments([(a, 90, 100), None, (b, 30, 70)], [90, 0, 40], [40, 5, 20])
    assert segments.rows.tolist() == [*range(0, 10), *range(45, 65)]
    assert segments.segment.tolist() == [0] * 10 + [1] * 20
    assert segments.decays == (a, b) and segments.counts == (10, 20) and segments.end == 65
    assert bound_segments([None, (a, 10, 20)], [0, 20], [8, 5]) is None   # past the tail


def test_sums_over_chunks_give_the_replay_bound_of_the_whole_tail():
    gen = torch.Generator().manual_seed(0)
    tokens, heads = [150, 37], 4
    tails = [(TailDecay(), 0, 100), (TailDecay(), 0, 37)]     # request 0: tail is 100 of its 150 tokens
    g = [-torch.rand(n, heads, generator=gen) for n in tokens]              # GDN layer 1
    dt = [torch.randn(n, heads, generator=gen) for n in tokens]              # Mamba-2 layer 3
    A, dt_bias = -torch.rand(heads, generator=gen) - 0.1, torch.randn(heads, generator=gen)
    a_log, gdn_bias = torch.randn(heads, generator=gen), torch.randn(heads, generator=gen)
    a = [torch.randn(n, heads, generator=gen) for n in tokens]                 # GDN layer 0's gate input
    _run_chunks(tails, tokens, chunk=64, layer_gates={
        0: [gdn_log_decay(x, a_log, gdn_bias) for x in a],
        1: g,
        3: [mamba2_log_decay(x, A, dt_bias, dt_softplus=True) for x in dt]})
    for (decay, _, end), g_i, dt_i, a_i in zip(tails, g, dt, a):
        assert decay.tokens == {0: end, 1: end, 3: end}
        torch.testing.assert_close(decay.sums[1].exp(), gdn_replay_bound(g_i[:end]))
        step = torch.nn.functional.softplus(dt_i[:end] + dt_bias)
        torch.testing.assert_close(decay.sums[3].exp(), mamba2_replay_bound(step, A))
        g0 = -a_log.exp() * torch.nn.functional.softplus(a_i[:end] + gdn_bias)
        torch.testing.assert_close(decay.sums[0].exp(), gdn_replay_bound(g0))
        bound = summarize(decay, end)
        expected = [decay.sums[layer].max().double().exp().item() for layer in (0, 1, 3)]
        assert bound.per_layer == pytest.approx(expected) and bound.state_bound == max(expected)


def test_mamba2_time_step_is_discretized_like_the_scan():
    dt, A = torch.tensor([[-30.0, 0.5]]), torch.tensor([-2.0, -1.0])
    raw = mamba2_log_decay(dt, A)
    assert raw.tolist() == [[60.0, -0.5]]                        # no bias, no softplus: as given
    clamped = mamba2_log_decay(dt, A, dt_softplus=True, dt_limit=(0.01, 0.2))
    assert clamped[0].tolist() == pytest.approx([-0.02, -0.2])


def test_a_tail_the_forward_did_not_fully_see_has_no_bound():
    decay = TailDecay()
    decay.add(0, torch.tensor([-1.0, -2.0]), 30)
    decay.add(2, torch.tensor([-0.5, -0.1]), 40)
    assert summarize(decay, 40) is None                 # layer 0 missed 10 tokens (e.g. a CUDA graph)
    assert summarize(TailDecay(), 40) is None           # no linear layer seen at all
    decay.add(0, torch.tensor([-1.0, -1.0]), 10)
    assert summarize(decay, 40).per_layer == pytest.approx([torch.tensor(-2.0).exp().item(),
                                                            torch.tensor(-0.1).exp().item()])
    assert summarize(TailDecay(), 0).state_bound == 1.0   # nothing replayed: the whole state is dropped


def _record(kind: HitKind, matched=100, prefix=90) -> TailReplayRequest:
    record = TailReplayRequest(config=DEFAULTS)
    record.set_plan(ReplayPlan(kind, matched, prefix if kind is not HitKind.MISS else 0, prefix))
    return record


@pytest.mark.parametrize("kind", [HitKind.EXACT_CHECKPOINT, HitKind.EXACT_REPLAY, HitKind.MISS])
def test_exact_hits_and_misses_report_no_bound(kind):
    assert not any(key.startswith("state_bound") for key in replay_summary(_record(kind)))


def test_approximate_hit_reports_its_bound_and_a_rematch_starts_over(monkeypatch):
    from sglang_ext.tail_replay import metrics

    observed = []
    monkeypatch.setattr(metrics, "record_bound", observed.append)
    record = _record(HitKind.APPROXIMATE)
    assert replay_summary(record)["state_bound"] is None        # the forward saw no gates: unknown
    assert observed == []
    record.set_plan(record.plan)                                 # re-match after a retraction
    record.tail_decay.add(5, torch.tensor([-0.5, -3.0]), 10)
    summary = replay_summary(record)
    assert summary["state_bound"] == pytest.approx(torch.tensor(-0.5).exp().item())
    assert summary["state_bound_per_layer"] == [summary["state_bound"]]
    assert replay_summary(record) == summary and observed == [summary["state_bound"]]   # once per request
