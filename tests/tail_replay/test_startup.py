"""Start-up checks, per-request limits, request-field validation and the cached config reader
(pure parts; the live-server side is tests/e2e/test_request_hardening.py)."""

from __future__ import annotations

import dataclasses
import logging
from types import SimpleNamespace

import pytest

from sglang_ext import env
from sglang_ext.tail_replay import config as config_module
from sglang_ext.tail_replay import server_config
from sglang_ext.tail_replay.config import TailReplayConfig, TailReplayConfigError
from sglang_ext.tail_replay.request_fields import RequestLimits, request_overrides
from sglang_ext.tail_replay.startup import (
    PoolFacts,
    ServerFacts,
    StartupError,
    apply_unified_memory_default,
    check_scheduler_start,
    check_start,
    kv_cache_is_quantized,
    pool_facts_from_server_args,
    pools_line,
    request_limits,
    summary_line,
    unified_memory_default,
)

BASE = TailReplayConfig()
NO_CKPT = TailReplayConfig.of(keep_checkpoints=False)
FP8 = ServerFacts(kv_cache_dtype="fp8_e4m3")


@pytest.mark.parametrize("custom, needle", [
    ("x", "sampling_params.custom_params must be a JSON object, got str"),
    ([1, 2], "sampling_params.custom_params must be a JSON object, got list"),
    (3, "sampling_params.custom_params must be a JSON object, got int"),
    ({"tail_replay": "x"}, "sampling_params.custom_params['tail_replay'] must be a JSON object, got str"),
    ({"tail_replay": [1]}, "sampling_params.custom_params['tail_replay'] must be a JSON object, got list"),
    ({"tail_replay": {"window": 3}}, "['tail_replay']: tail-replay config key 'window': unknown key"),
    ({"tail_replay": {"budget": "0.1"}}, "'budget': must be a number in [0, 1] or 'auto'"),
    ({"tail_replay": {"keep_checkpoints": 1}}, "'keep_checkpoints': has the wrong type"),
    ({"tail_replay": {"budget": 1.5}}, "'budget': must be in [0, 1]"),
    ({"tail_replay": {"min_replay_tokens": -1}}, "'min_replay_tokens': must be >= 0"),
    ({"tail_replay": {"max_replay_tokens": 8}}, "'max_replay_tokens': must be >= min_replay_tokens"),
    ({"tail_replay": {"kv_mode": "fast"}}, "'kv_mode': must be one of"),
])
def test_malformed_request_fields_name_the_field(custom, needle):
    with pytest.raises(ValueError) as err:   # SGLang answers a ValueError from verify with HTTP 400
        request_overrides(BASE, custom)
    assert needle in str(err.value)


def test_well_formed_requests_get_their_config():
    assert request_overrides(BASE, None) is BASE
    assert request_overrides(BASE, {"other_plugin": [1]}) is BASE       # other custom params pass through
    assert request_overrides(BASE, {"tail_replay": None}) is BASE
    assert request_overrides(BASE, {"tail_replay": {"budget": 0.5}}).knobs.budget == 0.5
    assert request_overrides(NO_CKPT, {"tail_replay": {"keep_checkpoints": False}}) == NO_CKPT


def test_refused_overrides_name_the_key_and_the_server_setting():
    limits = request_limits(NO_CKPT, ServerFacts())
    with pytest.raises(TailReplayConfigError, match=r"'keep_checkpoints': true is refused .*keep_checkpoints false"):
        request_overrides(NO_CKPT, {"tail_replay": {"keep_checkpoints": True}}, limits)
    # the same override is fine on a server with checkpoints
    ok = request_overrides(BASE, {"tail_replay": {"keep_checkpoints": True}}, request_limits(BASE, ServerFacts()))
    assert ok.knobs.keep_checkpoints
    recompute = TailReplayConfig.of(kv_mode="recompute")
    with pytest.raises(TailReplayConfigError, match=r"'kv_mode': 'exact' is refused .*--kv-cache-dtype fp8_e4m3"):
        request_overrides(recompute, {"tail_replay": {"kv_mode": "exact"}}, request_limits(recompute, FP8))
    assert request_overrides(recompute, {"tail_replay": {"budget": 0.2}}, request_limits(recompute, FP8)).knobs.budget == 0.2


def test_limits_follow_config_and_kv_dtype():
    assert request_limits(BASE, ServerFacts()) == RequestLimits()
    assert request_limits(NO_CKPT, ServerFacts()).checkpoints_refused
    assert request_limits(BASE, FP8).exact_kv_refused and not request_limits(BASE, FP8).checkpoints_refused


@pytest.mark.parametrize("dtype, quantized", [
    ("auto", False), ("bfloat16", False), ("bf16", False), ("float16", False), ("torch.float32", False),
    ("fp8_e4m3", True), ("fp8_e5m2", True), ("mxfp8", True), ("nvfp4", True), ("torch.float8_e4m3fn", True),
])
def test_kv_cache_is_quantized(dtype, quantized):
    assert kv_cache_is_quantized(dtype) is quantized


def test_exact_kv_with_a_quantized_cache_is_refused_naming_both_flags():
    with pytest.raises(StartupError) as err:
        check_start(BASE, FP8)
    assert "--kv-cache-dtype fp8_e4m3" in str(err.value) and "kv_mode 'exact'" in str(err.value)
    lines = check_start(TailReplayConfig.of(kv_mode="recompute"), FP8)
    assert len(lines) == 1 and "kv_mode='recompute'" in lines[0] and "kv_mode='exact' (its KV cache" in lines[0]


def test_hierarchical_cache_runs_and_its_unchecked_mode_is_refused_naming_the_flag():
    """The host tier and a storage tier run (the summary says what storage gets); the staging-buffer
    host mode, not checked against the planner, is refused by name."""
    assert "storage tier" not in check_start(BASE, ServerFacts(hierarchical_cache=True))[0]
    with pytest.raises(StartupError, match="--hicache-host-memory-mode buffer_only"):
        check_start(BASE, ServerFacts(hierarchical_cache=True, hicache_host_memory_mode="buffer_only"))
    line = check_start(BASE, ServerFacts(hierarchical_cache=True, hicache_storage_backend="file"))[0]
    assert line.endswith("; storage tier file: the attention KV of strictly exact nodes only (no states)")
    args = SimpleNamespace(kv_cache_dtype="auto", model_path="m", enable_hierarchical_cache=True,
                           hicache_host_memory_mode="buffer_only", hicache_storage_backend="mooncake")
    from sglang_ext.tail_replay import facts_from_server_args

    facts = facts_from_server_args(args)
    assert facts.hierarchical_cache and facts.hicache_host_memory_mode == "buffer_only"
    assert facts.hicache_storage_backend == "mooncake"


def test_summary_line_names_the_config_and_refusals():
    line = summary_line(NO_CKPT, ServerFacts())
    assert line.startswith("Tail-Replay config in force: budget=0.05 min_replay_tokens=64")
    assert "keep_checkpoints=False kv_mode='exact'" in line
    assert "per-request overrides refused: keep_checkpoints=true (" in line
    assert summary_line(BASE, ServerFacts()).endswith("per-request overrides refused: none")


def _ctx(tp_rank, pool_dtype, flag="auto"):
    runner = SimpleNamespace(kv_cache_dtype=pool_dtype)
    return SimpleNamespace(tp_rank=tp_rank, tp_worker=SimpleNamespace(model_runner=runner),
                           server_args=SimpleNamespace(kv_cache_dtype=flag))


def test_scheduler_check_uses_the_resolved_kv_dtype_and_logs_on_rank_0_only(caplog):
    import torch

    recompute = TailReplayConfig.of(kv_mode="recompute")
    # `--kv-cache-dtype auto` that SGLang resolved to fp8 (a checkpoint asking for an fp8 KV cache)
    with pytest.raises(StartupError, match="float8_e4m3fn"):
        check_scheduler_start(_ctx(0, torch.float8_e4m3fn), BASE)
    # ... is refused in recompute mode too: the request check sees only the flag, which must name it
    with pytest.raises(StartupError, match=r"--kv-cache-dtype auto gave a quantized KV cache .*explicitly"):
        check_scheduler_start(_ctx(0, torch.float8_e4m3fn), recompute)
    check_scheduler_start(_ctx(1, torch.float8_e4m3fn, flag="fp8_e4m3"), recompute)
    with caplog.at_level(logging.INFO, logger="sglang_ext.tail_replay.startup"):
        check_scheduler_start(_ctx(1, torch.bfloat16), BASE)
        assert not caplog.records
        check_scheduler_start(_ctx(0, torch.bfloat16), BASE)
    assert [r.getMessage().split(":")[0] for r in caplog.records] == ["Tail-Replay config in force", "Tail-Replay pools"]
    assert "kv cache dtype bfloat16" in caplog.records[0].getMessage()


def test_server_config_is_parsed_once_per_process(monkeypatch, tmp_path):
    path = tmp_path / "tr.json"
    path.write_text('{"budget": 0.25}')
    monkeypatch.setenv(env.TAIL_REPLAY_CONFIG_VAR, str(path))
    config_module._parsed.cache_clear()
    first = server_config()
    path.write_text('{"budget": 0.5}')            # not re-read: the config is fixed at start-up
    assert server_config() is first and first.knobs.budget == 0.25
    assert config_module._parsed.cache_info().misses == 1
    monkeypatch.setenv(env.TAIL_REPLAY_CONFIG_VAR, '{"budget": 0.125}')
    assert server_config().knobs.budget == 0.125
    config_module._parsed.cache_clear()


@pytest.mark.parametrize("value, refused", [("1", True), ("True", True), ("y", True), ("0", False), ("", False)])
def test_sglangs_rust_server_is_refused_naming_the_variable(monkeypatch, value, refused):
    """SGLang's Rust HTTP server and tokenizer replace the Python tokenizer process where the
    request checks run: requests would reach the scheduler unchecked, so the server does not start."""
    from sglang_ext.tail_replay.startup import facts_from_server_args

    monkeypatch.setenv("SGLANG_RUST_SERVER", value)
    facts = facts_from_server_args(SimpleNamespace(kv_cache_dtype="auto", model_path=""))
    assert facts.rust_server is refused
    if refused:
        with pytest.raises(StartupError, match="SGLANG_RUST_SERVER"):
            check_start(TailReplayConfig(), facts)
    else:
        assert check_start(TailReplayConfig(), facts)


# ---------------------------------------------------------------- one byte budget by default


@pytest.mark.parametrize("facts, reason", [
    (PoolFacts(), None),
    (PoolFacts(attention_backends=("torch_native", None, None)), None),
    (PoolFacts(attention_backends=("fa3", "flashinfer", None), linear_attn_backends=("triton", None, "flashkda")), None),
    (PoolFacts(hierarchical_cache=True), "--enable-hierarchical-cache"),
    (PoolFacts(disaggregation_mode="prefill"), "--disaggregation-mode prefill"),
    (PoolFacts(kv_cache_sharding=True), "--enable-kv-cache-sharding"),
    (PoolFacts(kv_cache_dtype="nvfp4"), "--kv-cache-dtype nvfp4"),
    (PoolFacts(speculative_algorithm="EAGLE"), "--speculative-algorithm EAGLE"),
    (PoolFacts(attention_backends=("intel_amx", None, None)), "attention backend ['intel_amx']"),
    (PoolFacts(linear_attn_backends=("cutedsl", None, None)), "linear-attention backend ['cutedsl']"),
    (PoolFacts(linear_attn_backends=(None, "flashkda", None)), "linear-attention backend ['flashkda']"),
    (PoolFacts(mamba_backend="flashinfer"), "--mamba-backend flashinfer"),
    (PoolFacts(picked_backend_admitted=False), "no --attention-backend given"),
    (PoolFacts(attention_backends=("triton", None, None), picked_backend_admitted=False), None),
])
def test_one_byte_budget_unless_a_flag_rules_it_out_naming_the_flag(facts, reason):
    why = unified_memory_default(BASE, facts)
    assert why is None if reason is None else why.startswith(reason)
    # the operator's own --enable-unified-memory stands, whatever else is set
    assert unified_memory_default(BASE, dataclasses.replace(facts, unified_memory=True)) is None


def test_byte_budget_false_keeps_the_static_pools():
    off = TailReplayConfig.of(byte_budget=False)
    assert unified_memory_default(off, PoolFacts()) == "the Tail-Replay config sets byte_budget false"


def test_the_default_is_applied_to_sglangs_own_server_args_before_resolution():
    from sglang.srt.server_args import prepare_server_args

    def args(*flags):
        return prepare_server_args(["--model-path", "/nonexistent", "--radix-cache-backend", "tail_replay", *flags])

    plain = args("--attention-backend", "torch_native")   # what the CPU launcher names
    assert pool_facts_from_server_args(plain) == PoolFacts(attention_backends=("torch_native", None, None),
                                                          linear_attn_backends=("triton", None, None),
                                                          mamba_backend="triton", picked_backend_admitted=False)
    line = apply_unified_memory_default(plain, BASE)
    assert plain.enable_unified_memory is True and line.startswith("Tail-Replay pools: one byte budget")
    unnamed = args()   # no backend named, on a machine without an NVIDIA GPU: SGLang's pick is not known
    assert apply_unified_memory_default(unnamed, BASE).endswith("(name one of triton, fa3, fa4, flashinfer, "
                                                                 "trtllm_mha, torch_native))")
    assert unnamed.enable_unified_memory is False
    hicache = args("--attention-backend", "torch_native", "--enable-hierarchical-cache")
    line = apply_unified_memory_default(hicache, BASE)
    assert hicache.enable_unified_memory is False
    assert line.startswith("Tail-Replay pools: SGLang's static KV and state pools (--enable-hierarchical-cache")
    sharded = args("--attention-backend", "torch_native", "--kv-cache-dtype", "fp8_e4m3", "--speculative-algorithm", "EAGLE")
    apply_unified_memory_default(sharded, BASE)
    assert sharded.enable_unified_memory is False
    assert "byte_budget eviction" in pools_line(BASE, SimpleNamespace(enable_unified_memory=True))
