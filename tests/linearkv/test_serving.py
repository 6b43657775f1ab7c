"""LinearKV serving core (pure): config, request spans, short-chunk joining, separator splitting."""

from __future__ import annotations

import pytest

from sglang_ext.linearkv.serving import (
    ChunkPlan,
    LinearKVConfig,
    LinearKVConfigError,
    LinearKVRequest,
    check_server_flags,
    composes,
    join_short,
    parse_config,
    plan_chunks,
    request_field,
    spans_of_segments,
    split_by_separator,
    summary,
)


def test_config_defaults_and_values():
    assert parse_config(None) == LinearKVConfig()
    assert parse_config('{"state": "zero", "min_chunk_tokens": 4, "separator": " # # "}') == LinearKVConfig(
        state="zero", min_chunk_tokens=4, separator=" # # ")


def test_selector_config_epic_k():
    assert parse_config('{"selector": "epic"}').selector == "epic-16"
    assert parse_config('{"selector": "epic", "k": 4}').selector == "epic-4"
    assert parse_config('{"selector": "epic-8"}') == LinearKVConfig(selector="epic-8", k=8)
    assert parse_config('{"selector": "epic-0"}').selector == "none"


def test_epic_heads_are_the_first_k_tokens_of_every_chunk_clipped():
    config = parse_config('{"selector": "epic-6", "min_chunk_tokens": 1}')
    plan = plan_chunks({"chunks": [[3, 20], [20, 24], [24, 40]]}, 50, config, can_compose=True)
    assert plan.heads == ((3, 9), (20, 24), (24, 30)) and plan.head_tokens == 16 and plan.selector == "epic-6"
    # per request: "none", "epic" (the server's k, else 16), "epic-<k>"
    assert plan_chunks({"chunks": [[3, 20]], "selector": "none"}, 50, config, can_compose=True).heads == ()
    assert plan_chunks({"chunks": [[3, 40]], "selector": "epic"}, 50, config, can_compose=True).heads == ((3, 9),)
    assert plan_chunks({"chunks": [[3, 40]], "selector": "epic"}, 50, LinearKVConfig(min_chunk_tokens=1), can_compose=True).k == 16
    assert plan_chunks({"chunks": [[3, 40]], "selector": "epic-2"}, 50, config, can_compose=True).heads == ((3, 5),)
    with pytest.raises(ValueError, match=r"custom_params.linearkv.selector: 'cacheblend-15' is not served"):
        plan_chunks({"chunks": [[3, 40]], "selector": "cacheblend-15"}, 50, config, can_compose=True)


@pytest.mark.parametrize(("text", "needle"), [
    ('{"selector": "cacheblend-15"}', "key 'selector': 'cacheblend-15' is not served"),
    ('{"selector": "epic-x"}', "key 'selector'"),
    ('{"selector": "epic-8", "k": 4}', "key 'k' = 4 contradicts"),
    ('{"selector": "epic", "k": -1}', "key 'k' must be an integer"),
    ('{"state": "packed-last"}', "key 'state'"),
    ('{"min_chunk_tokens": 0}', "key 'min_chunk_tokens'"),
    ('{"min_chunk_tokens": true}', "key 'min_chunk_tokens'"),
    ('{"separator": ""}', "key 'separator'"),
    ('{"kk": 16}', "unknown key 'kk'"),
    ("[1]", "must be a JSON object"),
    ("{", "not valid JSON"),
])
def test_bad_config_names_the_key(text, needle):
    with pytest.raises(LinearKVConfigError, match=needle):
        parse_config(text)


def test_plan_chunks_accepts_contiguous_spans_and_joins_short_ones():
    config = LinearKVConfig(min_chunk_tokens=10)
    plan = plan_chunks({"chunks": [[5, 20], [20, 24], [24, 40]]}, 50, config, can_compose=True)
    assert plan == ChunkPlan(((5, 20), (20, 40)), "predecessor")
    assert (plan.prefix_end, plan.question_start, plan.chunk_tokens) == (5, 40, 35)
    assert plan_chunks({"chunks": [[0, 4]], "state": "zero"}, 10, config, can_compose=True) is None   # all joined into Q


@pytest.mark.parametrize(("value", "needle"), [
    ({"chunks": [[0, 10], [11, 20]]}, r"chunks\[1\] starts at 11 but chunk 0 ends at 10"),
    ({"chunks": [[3, 3]]}, r"chunks\[0\] = \[3, 3\]"),
    ({"chunks": [[0, 50]]}, "at least one question token"),
    ({"chunks": [[0, "9"]]}, r"chunks\[0\] must be \[start, end\]"),
    ({"chunks": []}, "non-empty list"),
    ({"chunks": [[0, 10]], "state": "packed-last"}, "custom_params.linearkv.state"),
])
def test_bad_spans_name_the_field(value, needle):
    with pytest.raises(ValueError, match=needle):
        plan_chunks(value, 50, LinearKVConfig(min_chunk_tokens=1), can_compose=True)


def test_compose_only_where_the_model_composes():
    config = LinearKVConfig(min_chunk_tokens=1)
    assert plan_chunks({"chunks": [[0, 10]], "state": "compose"}, 20, config, can_compose=True).state == "compose"
    with pytest.raises(ValueError, match="served for Mamba-2 models only"):
        plan_chunks({"chunks": [[0, 10]], "state": "compose"}, 20, config, can_compose=False)
    assert composes(["mamba", "attention"], "nemotron_h")
    assert not composes(["linear_attention", "full_attention"], "qwen3_next")
    assert not composes(None, "qwen3_5_text")


def test_request_field_checks_shape_and_keys():
    assert request_field(None) is None and request_field({"other": 1}) is None
    with pytest.raises(ValueError, match="custom_params.linearkv must be a JSON object"):
        request_field({"linearkv": [1]})
    with pytest.raises(ValueError, match="unknown key 'chunk'"):
        request_field({"linearkv": {"chunk": []}})


def test_join_short_keeps_spans_contiguous():
    assert join_short([(0, 3), (3, 5), (5, 20), (20, 22)], 5) == [(0, 5), (5, 20)]
    assert join_short([(0, 10)], 11) == []


def test_separator_segments_to_spans():
    assert split_by_separator("sys|a|b|q", "|") == ["sys", "a", "b", "q"]
    assert split_by_separator("sys|q", "|") is None
    assert spans_of_segments([3, 5, 0, 4, 2]) == [[3, 8], [8, 12]]


def test_summary_and_server_flags():
    record = LinearKVRequest(plan=ChunkPlan(((0, 8),), "zero"), chunks_hit=1, reused_tokens=8,
                             recomputed_tokens=3, state_source="zero", assembled=True)
    assert summary(record) == {"chunks_hit": 1, "chunks_missed": 0, "reused_tokens": 8, "recomputed_tokens": 3,
                               "state_source": "zero", "selector": "none"}

    assert summary(LinearKVRequest(chunks_missed=2, recomputed_tokens=40, fallback="cut")) == {
        "chunks_hit": 0, "chunks_missed": 2, "reused_tokens": 0, "recomputed_tokens": 40,
        "state_source": "none", "selector": "none", "fallback": "cut"}


@pytest.fixture(scope="module")
def server_args(tiny_model_factory):
    """SGLang's own ServerArgs (the object check_server_flags reads in the server) for a tiny
    hybrid model, before SGLang resolves `auto`."""
    from sglang.srt.server_args import ServerArgs

    from sglang_ext import patches  # noqa: F401  (the CPU patches SGLang needs to import here)

    path = str(tiny_model_factory("qwen3-next"))

    def make(**flags):
        return ServerArgs(model_path=path, device="cpu", radix_cache_backend="linearkv", **flags)

    return make


def test_server_flags_on_sglangs_server_args(server_args):
    for strategy in ("no_buffer", "extra_buffer", "auto"):   # auto resolves to one of the two
        check_server_flags(server_args(mamba_radix_cache_strategy=strategy))
    with pytest.raises(ValueError, match="--mamba-radix-cache-strategy extra_buffer_lazy"):
        check_server_flags(server_args(mamba_radix_cache_strategy="extra_buffer_lazy"))
    with pytest.raises(ValueError, match="--page-size 1"):
        check_server_flags(server_args(page_size=16))
    with pytest.raises(ValueError, match="--enable-hierarchical-cache"):
        check_server_flags(server_args(enable_hierarchical_cache=True))
    with pytest.raises(ValueError, match="--enable-dp-attention"):
        check_server_flags(server_args(enable_dp_attention=True))
    args = server_args(mamba_radix_cache_strategy="extra_buffer_lazy")
    args.radix_cache_backend = "tail_replay"
    check_server_flags(args)   # other backends pass


def test_tenant_namespaces_are_apart_and_recognised():
    from sglang_ext.linearkv.serving import is_chunk_namespace, namespace, tenant_namespace

    ns = namespace("m")
    keys = {tenant_namespace(ns, k) for k in (None, "", "a", "b")}
    assert len(keys) == 3   # None and "" are the same (no extra_key), as SGLang normalizes them
    assert all(is_chunk_namespace(k) for k in keys)
    assert not is_chunk_namespace(None) and not is_chunk_namespace("tenant-a")
    # a registration's key (+ the LoRA id SGLang appends) is the key its request looks up
    assert tenant_namespace(ns, "a") + "lora7" == tenant_namespace(ns, "a" + "lora7")


def test_kv_events_recorder_leaves_chunk_nodes_out():
    """SGLang's own recorder: a chunk node is neither stored nor removed, a prompt node is."""
    from types import SimpleNamespace

    from sglang.srt.mem_cache.events import KVCacheEventRecorder
    from sglang.srt.mem_cache.radix_cache import RadixKey

    from sglang_ext.linearkv.factory import hide_chunk_events

    recorder = KVCacheEventRecorder(enabled=True, page_size=1)
    hide_chunk_events(recorder)
    root = SimpleNamespace(parent=None, hash_value=[], event_hash_value=[], key=RadixKey([]))

    def node(ids, extra_key):
        return SimpleNamespace(key=RadixKey(ids, extra_key), parent=root, hash_value=None, event_hash_value=None)

    chunk, prompt = node([5, 6, 7], "linearkv-chunk:m|"), node([1, 2], None)
    for n in (chunk, prompt):
        recorder.record_store(n)
        recorder.record_remove(n)
    events = recorder.take()
    assert [type(e).__name__ for e in events] == ["BlockStored", "BlockRemoved"]
    assert events[0].token_ids == [1, 2]


def test_replay_rule_plans_its_spans():
    from sglang_ext.linearkv.serving import keeps_state, state_rule

    assert state_rule("replay") == ("replay", 64) and state_rule("replay-8") == ("replay", 8)
    assert state_rule("zero") == ("zero", 0) and state_rule("replay-0") == ("replay-0", 0)
    with pytest.raises(ValueError, match="custom_params.linearkv.state"):
        plan_chunks({"chunks": [[10, 30]], "state": "replay-x"}, 40, LinearKVConfig(), can_compose=True)
    plan = plan_chunks({"chunks": [[10, 30], [30, 60]], "state": "replay-16"}, 70, LinearKVConfig(), can_compose=True)
    assert (plan.state, plan.replay, plan.forward_start, plan.heads) == ("replay", 16, 44, ())
    assert plan.recomputed_chunk_tokens == 16 and plan.seeds_zero and not keeps_state(plan)
    # never back into P: a replay longer than the chunks starts at P's end
    assert plan_chunks({"chunks": [[10, 30]], "state": "replay"}, 40, LinearKVConfig(), can_compose=True).forward_start == 10
    # EPIC: head j > 0 starts up to r tokens back, never before head j-1's end; the question too
    epic = ChunkPlan(((10, 14), (14, 60)), "replay", k=4, replay=8)
    assert epic.heads == ((10, 14), (14, 18)) and epic.forward_start == 52
    epic = ChunkPlan(((10, 30), (30, 60)), "replay", k=4, replay=8)
    assert epic.heads == ((10, 14), (22, 34)) and epic.forward_start == 52
    assert epic.head_tokens == 16 and epic.recomputed_chunk_tokens == 24
    assert ChunkPlan(((10, 30),), "predecessor", k=4).forward_start == 30
    assert keeps_state(ChunkPlan(((10, 30),), "predecessor")) and keeps_state(ChunkPlan(((10, 30),), "compose"))


def test_the_scheduler_parses_a_record_with_the_plan_the_tokenizer_validated():
    """One parse site (`plan_chunks`, no can_compose default): the scheduler's record of a
    `compose` request on a model that cannot compose is a plain prefill saying why (the tokenizer
    refused the same field with a 400); a registration is a registration; a layout cut by
    --allow-auto-truncate falls back; no field, no record."""
    from sglang_ext.linearkv.serving import parse_record

    config = LinearKVConfig(min_chunk_tokens=1)
    custom = {"linearkv": {"chunks": [[0, 10]], "state": "compose"}}
    assert parse_record(custom, 20, config, can_compose=True).plan.state == "compose"
    refused = parse_record(custom, 20, config, can_compose=False)
    assert refused.plan is None and "Mamba-2 models only" in refused.fallback and refused.declared_chunks == 1
    with pytest.raises(ValueError, match="Mamba-2 models only"):   # the tokenizer's answer (HTTP 400)
        plan_chunks(custom["linearkv"], 20, config, can_compose=False)
    with pytest.raises(TypeError):   # no default: every caller states what its model does
        plan_chunks(custom["linearkv"], 20, config)
    reg = parse_record({"linearkv": {"register": True, "keep_state": False}}, 10, config, can_compose=False)
    assert reg.register and not reg.keep_state
    cut = parse_record({"linearkv": {"chunks": [[0, 10]]}}, 10, config, can_compose=True)
    assert cut.fallback is not None and "10-token prompt as served" in cut.fallback
    assert parse_record({"other": 1}, 10, config, can_compose=True) is None
    assert parse_record(None, 10, config, can_compose=True) is None


def test_each_request_kind_has_one_caching_rule():
    """The Mamba component's table: what each kind inserts and does with its state."""
    from sglang_ext.linearkv.mamba_component import CACHING, request_kind

    plan = ChunkPlan(((4, 20),), "predecessor")
    kinds = [
        (None, "plain"),
        (LinearKVRequest(plan=plan), "fallback"),
        (LinearKVRequest(fallback="cut"), "fallback"),
        (LinearKVRequest(plan=plan, assembled=True), "assembled"),
        (LinearKVRequest(register=True), "register_state"),
        (LinearKVRequest(register=True, keep_state=False), "register_kv"),
        (LinearKVRequest(register=True, register_hit=True), "register_hit"),
        (LinearKVRequest(register=True, keep_state=False, register_hit=True), "register_hit"),
    ]
    assert {kind for _, kind in kinds} == set(CACHING)
    for record, kind in kinds:
        assert request_kind(record) == kind
    assert (CACHING["assembled"].inserts, CACHING["assembled"].when_cached) == ("prefix", "withhold")
    assert CACHING["register_state"].when_cached == "end" and CACHING["register_hit"].at_match == "clear"
    assert all(CACHING[k].inserts == "all" for k in ("register_kv", "register_state", "register_hit"))
    assert all((rule.inserts, rule.at_match, rule.when_cached) == ("tail_replay",) * 3
               for k, rule in CACHING.items() if k in ("plain", "fallback"))


def test_a_request_with_chunks_served_exactly_is_a_plain_prefill_that_says_why():
    from sglang_ext.linearkv.serving import EXACT_FALLBACK, parse_record, served_exactly, summary

    config = LinearKVConfig(min_chunk_tokens=1)
    record = parse_record({"linearkv": {"chunks": [[4, 20], [20, 30]]}}, 40, config, can_compose=False)
    exact = served_exactly(record)
    assert exact.plan is None and exact.fallback == EXACT_FALLBACK and exact.declared_chunks == 2
    assert summary(exact)["fallback"] == EXACT_FALLBACK


def test_exact_requests_mode_is_checked_at_start():
    assert parse_config('{"exact_requests": "refuse"}').exact_requests == "refuse"
    with pytest.raises(LinearKVConfigError, match="'exact_requests' must be one of"):
        parse_config('{"exact_requests": "never"}')
