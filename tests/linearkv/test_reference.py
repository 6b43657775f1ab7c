"""LinearKV reference path over the tiny GDN (Qwen3-Next) and Mamba-2 (Nemotron-H) fixtures."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from eval.reference import load_reference_model
from sglang_ext.linearkv import ChunkReferenceError, ops, parse_selector
from sglang_ext.linearkv import reference as R
from sglang_ext.linearkv.initializers import Seed

ARCHS = ("qwen3-next", "nemotron-h")


@pytest.fixture(scope="module", params=ARCHS)
def tiny(request, tiny_model_factory):
    torch.manual_seed(0)
    model = load_reference_model(tiny_model_factory(request.param))
    layout = R.model_layout(model, model_id=f"tiny-{request.param}")
    return model, layout


def _ids(n, seed):
    return torch.randint(5, 500, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _one_chunk(model, layout):
    """A 130-token chunk registered alone, a 20-token question, and their full prefill."""
    ids = _ids(150, 1)
    chunk, question = ids[:130], ids[130:]
    store = R.new_store(layout)
    entry = R.register(model, layout, chunk, store)
    return ids, question, store, entry, R.full_prefill(model, layout, chunk, question)


def test_one_chunk_without_prefix_is_a_plain_continuation(tiny):
    model, layout = tiny
    ids, question, store, entry, full = _one_chunk(model, layout)
    ref_out, ref_lp = R.greedy(model, full.cache, full.logits[-1], len(ids), 6)
    for rule in ("predecessor", "compose", "packed-last", "packed-compose"):
        got = R.assemble(model, layout, [entry.chunk_id], question, parse_selector("none"), rule, store=store)
        assert got.recomputed == list(range(130, 150))
        torch.testing.assert_close(got.logits, full.logits, atol=1e-5, rtol=1e-5)
        out, lp = R.greedy(model, got.cache, got.logits[-1], len(ids), 6)
        assert out == ref_out, rule
        assert lp == pytest.approx(ref_lp, abs=1e-4)


def test_replay_rule_rebuilds_the_state_from_a_tail(tiny):
    """KV-only `replay-<r>`: a replay that reaches back to the prompt's start (one chunk, no
    prefix) recomputes every token from the zero state in context: the full prefill. A short one
    recomputes only its tail (and the question) and reads no chunk state: a chunk stored with its
    linear states zeroed gives the same answer, closer to the full prefill than `zero`'s."""
    model, layout = tiny
    _, question, store, entry, full = _one_chunk(model, layout)
    whole = R.assemble(model, layout, [entry.chunk_id], question, parse_selector("none"), "replay-130", store=store)
    assert whole.recomputed == list(range(150))
    torch.testing.assert_close(whole.logits, full.logits, atol=1e-5, rtol=1e-5)
    tail = R.assemble(model, layout, [entry.chunk_id], question, parse_selector("none"), "replay-24", store=store)
    assert tail.recomputed == list(range(106, 150))
    blank = dataclasses.replace(entry, linear={
        i: R.LinearLayerState(torch.zeros_like(s.state), torch.zeros_like(s.conv)) for i, s in entry.linear.items()})
    tail_blank = R.assemble(model, layout, [blank], question, parse_selector("none"), "replay-24")
    torch.testing.assert_close(tail_blank.logits, tail.logits, atol=0, rtol=0)
    # the 24 replayed tokens bring it closer to the full prefill than starting the question from zero
    zero = R.assemble(model, layout, [entry.chunk_id], question, parse_selector("none"), "zero", store=store)
    err = [(x.logits - full.logits).abs().max().item() for x in (tail, zero)]
    assert err[0] < err[1], err


def test_exact_composition_equals_sequential_prefill(tiny):
    """Linear layers fed their in-context inputs chunk by chunk (zero state; the conv window of
    the chunk before, as in context): composing the chunks' end states with their transitions
    gives the sequential prefill's states, and decoding the question from those states plus the
    prefill's own attention KV gives its logits."""
    model, layout = tiny
    ids = _ids(170, 2)
    bounds = [0, 1, 41, 106, 150]               # a one-token chunk, one across the 64-token GDN chunk grid
    context, question = ids[:150], ids[150:]
    inputs: dict[int, torch.Tensor] = {}

    def keep_first(i, args, kwargs):            # the context's call, not the question's
        inputs.setdefault(i, (args[0] if args else kwargs["hidden_states"]).detach().clone())

    hooks = [R.mixer_of(model, layout, i).register_forward_pre_hook(
        lambda m, a, kw, i=i: keep_first(i, a, kw), with_kwargs=True) for i in layout.linear_layers]
    try:
        full = R.full_prefill(model, layout, context, question)
    finally:
        for h in hooks:
            h.remove()
    chunks, conv = [], None
    for s, e in zip(bounds, bounds[1:]):
        states = R.mixer_states(model, layout, {i: inputs[i][:, s:e] for i in layout.linear_layers}, conv)
        conv = {i: st.conv for i, st in states.items()}
        chunks.append(states)
    final = {}
    for i in layout.linear_layers:
        single = ops.compose(layout.kind, [chunks[0][i].state], [chunks[0][i].transition])
        torch.testing.assert_close(single, chunks[0][i].state)                 # one chunk: identity
        composed = ops.compose(layout.kind, [c[i].state for c in chunks], [c[i].transition for c in chunks])
        torch.testing.assert_close(composed, full.context_states[i].state, atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(chunks[-1][i].conv, full.context_states[i].conv)
        final[i] = Seed(composed[None], chunks[-1][i].conv[None])
    kv = {i: (full.cache.layers[i].keys[:, :, :150], full.cache.layers[i].values[:, :, :150])
          for i in layout.attention_layers}
    cache = R.cache_from(model, layout, kv, final)
    logits = model(torch.tensor([question]), position_ids=torch.arange(150, 170)[None], past_key_values=cache,
                   use_cache=True).logits[0]
    torch.testing.assert_close(logits, full.logits, atol=1e-4, rtol=1e-4)


def test_gdn_transition_trick_equals_product_of_token_matrices():
    from transformers.models.qwen3_next.modeling_qwen3_next import l2norm, torch_chunk_gated_delta_rule

    from hybrid_kernels.gdn import gdn_chunk_transition_ref

    g_ = torch.Generator().manual_seed(3)
    for t, h, dk in ((1, 1, 8), (70, 3, 16), (129, 2, 8)):
        q, k = torch.randn(1, t, h, dk, generator=g_), torch.randn(1, t, h, dk, generator=g_)
        g = -torch.rand(1, t, h, generator=g_) * 0.2
        beta = torch.rand(1, t, h, generator=g_)
        trick = R.gdn_transition_by_state(torch_chunk_gated_delta_rule, q, k, g, beta, use_qk_l2norm_in_kernel=True)
        direct = gdn_chunk_transition_ref(l2norm(k[0], dim=-1, eps=1e-6), g[0], beta[0])
        torch.testing.assert_close(trick[0], direct, atol=1e-5, rtol=1e-5)


def test_relocated_keys_equal_keys_computed_at_the_new_positions(tiny):
    model, layout = tiny
    ids = _ids(40, 4)
    entry = R.register(model, layout, ids)
    for delta in (1, 37, 1000):
        cache = R.new_cache(model)
        model(torch.tensor([ids]), position_ids=(delta + torch.arange(40))[None], past_key_values=cache, use_cache=True)
        for i in layout.attention_layers:
            moved = R.relocated_keys(layout, entry.kv[i][0], delta)
            torch.testing.assert_close(moved, cache.layers[i].keys[0], atol=2e-5, rtol=1e-5)
            if layout.rope is not None:                          # partial rotary: the tail is untouched
                rd, cached = layout.rope.rotary_dim, entry.kv[i][0]
                assert rd < moved.shape[-1]
                assert not torch.allclose(moved[..., :rd], cached[..., :rd])
                torch.testing.assert_close(moved[..., rd:], cached[..., rd:])


def test_selectors_recompute_what_they_say(tiny):
    model, layout = tiny
    ids = _ids(130, 5)
    store = R.new_store(layout)
    parts = [ids[:10], ids[10:50], ids[50:120]]
    refs = [R.register(model, layout, c, store).chunk_id for c in parts]
    prefix, question = _ids(7, 6), ids[120:]
    epic = R.assemble(model, layout, refs, question, parse_selector("epic-16"), "predecessor", prefix, store)
    assert epic.chunk_spans == [(7, 17), (17, 57), (57, 127)] and epic.suffix_span == (127, 137)
    assert epic.recomputed == [*range(7, 17), *range(17, 33), *range(57, 73), *range(127, 137)]
    blend = R.assemble(model, layout, refs, question, parse_selector("cacheblend-0.25"), "predecessor", prefix, store)
    chosen = [p for p in blend.recomputed if p < 127]
    assert len(chosen) == int(0.25 * 120) and all(7 <= p < 127 for p in chosen)
    assert blend.recomputed[-10:] == list(range(127, 137))
    # everything recomputed at every attention layer, with only linear layers before the check layer
    # (the tiny Qwen3-Next), is a full prefill
    full = R.full_prefill(model, layout, prefix + ids[:120], question)
    all_blend = R.assemble(model, layout, refs, question, parse_selector("cacheblend-1.0"), "zero", prefix, store)
    if max(layout.linear_layers) < layout.check_layer:
        torch.testing.assert_close(all_blend.logits, full.logits, atol=1e-4, rtol=1e-4)
    naive = R.assemble(model, layout, refs, question, parse_selector("none"), "predecessor", prefix, store)
    assert not torch.allclose(naive.logits, full.logits, atol=1e-3)       # PIC is approximate


def test_bad_chunk_references_name_the_chunk(tiny):
    model, layout = tiny
    store = R.new_store(layout)
    ids = _ids(20, 7)
    good = R.register(model, layout, ids, store)
    q = ids[:3]
    none = parse_selector("none")
    with pytest.raises(ChunkReferenceError, match="'0123abcd': unknown id"):
        R.assemble(model, layout, [good.chunk_id, "0123abcd"], q, none, "predecessor", store=store)
    other_layout = R.model_layout(model, model_id="some-other-model")
    foreign = R.register(model, other_layout, ids)
    with pytest.raises(ChunkReferenceError, match=f"{foreign.chunk_id}: belongs to model 'some-other-model'"):
        R.assemble(model, layout, [foreign], q, none, "predecessor", store=store)
    from dataclasses import replace

    half = replace(good, dtype=torch.bfloat16, kv={i: (k.bfloat16(), v.bfloat16()) for i, (k, v) in good.kv.items()})
    with pytest.raises(ChunkReferenceError, match=f"{good.chunk_id}: dtype torch.bfloat16"):
        R.assemble(model, layout, [half], q, none, "predecessor", store=store)
    bare = R.register(model, layout, ids[:10], transitions=False)
    with pytest.raises(ChunkReferenceError, match=f"{bare.chunk_id}: registered without transitions"):
        R.assemble(model, layout, [bare], q, none, "compose")
