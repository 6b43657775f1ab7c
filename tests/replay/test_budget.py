"""Equal-bytes budgets (eval/replay/budget.py): the real models' bytes, each server's split of a
budget (exact numbers), the flags a split gives the fixture server, the sweep, bad budgets."""

from __future__ import annotations

import pytest

from eval.replay.budget import (
    BudgetError,
    equal_bytes_specs,
    slots_per_running_request,
    split_table,
    stock_split,
    tail_replay_split,
)
from eval.replay.cli import build_parser
from eval.replay.inputs import ReplayError
from eval.replay.real_models import MIB, MODELS, real_model
from eval.replay.report import replay_title
from eval.replay.runner import _common_args, _plan, token_scale
from eval.replay.servers import parse_server_spec

QWEN3_NEXT = MODELS["qwen3-next-80b-a3b"]
SLOT, KV = 77_266_944, 24_576
BUDGET = 4 << 30     # 4,294,967,296 B


def test_qwen3_next_bytes_from_its_config():
    # 12 full-attention layers x K,V x 2 KV heads x 256 x bf16
    assert QWEN3_NEXT.kv_bytes_per_token == KV == 24 * 1024
    # 36 GDN layers x (32 x 128 x 128 float32 SSM + 3 x 8192 bf16 conv)
    assert QWEN3_NEXT.state_bytes_per_slot == SLOT == 36 * (32 * 128 * 128 * 4 + 3 * 8192 * 2)
    assert SLOT / MIB == pytest.approx(73.69, abs=0.005)
    assert QWEN3_NEXT.slot_in_kv_tokens == 3144.0
    with pytest.raises(ValueError, match="unknown model 'gpt'"):
        real_model("gpt")


def test_slots_per_running_request_follow_sglang():
    assert [slots_per_running_request(s) for s in ("no_buffer", "extra_buffer", "extra_buffer_lazy", "auto")] == [3, 5, 4, 5]
    # a Tail-Replay tree without states: the request's own slot and its track slots
    assert [slots_per_running_request(s, tree_states=False) for s in ("no_buffer", "extra_buffer", "extra_buffer_lazy")] == [1, 3, 3]
    with pytest.raises(BudgetError, match="'ping_pong'"):
        slots_per_running_request("ping_pong")


def test_stock_split_is_sglang_sizing():
    split = stock_split("stock", QWEN3_NEXT, BUDGET, "extra_buffer")
    # state budget 4 GiB x 0.9 / 1.9 = 2,034,458,203.8 B; K = (that - SLOT) // SLOT = 25
    assert (split.state_slots, split.running_requests) == (25, 25 // 5)
    assert split.state_bytes == 26 * SLOT == 2_008_940_544            # + the padding slot
    assert split.kv_tokens == (BUDGET - 26 * SLOT) // KV == 93_018
    assert split.kv_bytes == 93_018 * KV and split.state_bytes + split.kv_bytes <= BUDGET
    assert stock_split("s", QWEN3_NEXT, BUDGET, "extra_buffer", full_memory_ratio=0.5).state_slots == 17
    assert split.flags() == ["--max-total-tokens", "93018", "--max-mamba-cache-size", "25"]


def test_tail_replay_split_is_its_running_batch_plus_checkpoints():
    split = tail_replay_split("tr", QWEN3_NEXT, BUDGET, running=2, checkpoint_slots=8, strategy="extra_buffer")
    assert split.state_slots == 2 * 5 + 8 == 18
    assert split.kv_tokens == (BUDGET - 19 * SLOT) // KV == 115_026
    assert split.rule == "2 running x 5 slots (extra_buffer) + 8 checkpoint slots"
    bare = tail_replay_split("tr", QWEN3_NEXT, BUDGET, 2, 0, "extra_buffer", tree_states=False)
    assert (bare.state_slots, bare.kv_tokens) == (6, (BUDGET - 7 * SLOT) // KV)
    with pytest.raises(BudgetError, match="cannot hold 60 state slot"):
        tail_replay_split("tr", QWEN3_NEXT, BUDGET, running=10, checkpoint_slots=10)
    with pytest.raises(BudgetError, match="fewer than the 5 one running request needs"):
        stock_split("stock", QWEN3_NEXT, 8 * SLOT, "extra_buffer")


def _args(*extra: str):
    return build_parser().parse_args(["--out", "/tmp/unused", *extra])


def test_equal_bytes_plan_gives_each_server_its_flags_and_sweeps_tail_replay():
    args = _args("--equal-bytes-gib", "4", "--concurrency", "2", "--tail-replay-checkpoint-slots", "0", "8",
                 "--servers", "stock --mamba-radix-cache-strategy extra_buffer",
                 "tr=tail_replay --mamba-radix-cache-strategy extra_buffer",
                 'bare=tail_replay:{"keep_checkpoints": false} --mamba-radix-cache-strategy extra_buffer')
    specs, splits, lru_capacity = _plan(args)
    assert [s.label for s in specs] == ["stock --mamba-radix-cache-strategy extra_buffer", "tr@0ckpt", "tr@8ckpt", "bare"]
    assert [(s.state_slots, s.kv_tokens) for s in splits] == [
        (25, 93_018), (10, (BUDGET - 11 * SLOT) // KV), (18, 115_026), (6, (BUDGET - 7 * SLOT) // KV)]
    assert lru_capacity == BUDGET // KV
    launch = specs[2].launch_args(_common_args(args, splits[2]))
    assert launch[launch.index("--max-total-tokens") + 1] == "115026"
    assert launch[launch.index("--max-mamba-cache-size") + 1] == "18"
    assert launch.count("--max-total-tokens") == 1 and "--radix-cache-backend" in launch
    assert "equal bytes 4 GiB of qwen3-next-80b-a3b" in replay_title(
        {"name": "t", "requests": 1, "tokens_per_block": 1}, args)
    table = split_table([{"memory_split": s.as_dict(), "server_pools": [{"kv_tokens": 115026, "state_slots": 18,
                                                                        "max_running_requests": 4}]}
                         for s in splits])
    assert "| tr@8ckpt | 18 | 115,026 | 1 | 1.367 | 2.633 | 2 |" in table and "| 115026 / 18 / 4 |" in table


def test_a_replayed_token_is_priced_as_the_real_tokens_it_stands_for():
    """At 1 synthetic token per 64-token block a fixture token's KV costs 64 real tokens' bytes, so a
    state slot is worth 3,144 / 64 fixture tokens, not 3,144 (the real ratio of state to context)."""
    args = _args("--equal-bytes-gib", "4", "--concurrency", "2", "--tail-replay-checkpoint-slots", "8",
                 "--servers", "stock --mamba-radix-cache-strategy extra_buffer",
                 "tr=tail_replay --mamba-radix-cache-strategy extra_buffer")
    assert token_scale(args, {"block_tokens": 64, "tokens_per_block": 1}) == 64.0
    assert token_scale(args, {"block_tokens": 512, "tokens_per_block": 16}) == 32.0
    specs, splits, lru_capacity = _plan(args, 64.0)
    assert [(s.state_slots, s.kv_tokens) for s in splits] == [(25, (BUDGET - 26 * SLOT) // (64 * KV)),
                                                              (18, (BUDGET - 19 * SLOT) // (64 * KV))]
    assert all(s.kv_bytes == s.kv_tokens * 64 * KV and s.token_scale == 64.0 for s in splits)
    assert lru_capacity == BUDGET // (64 * KV)
    assert splits[0].kv_bytes + splits[0].state_bytes <= BUDGET < splits[0].state_bytes + (splits[0].kv_tokens + 1) * 64 * KV
    args.real_tokens_per_token = 1.0
    assert token_scale(args, {"block_tokens": 64, "tokens_per_block": 1}) == 1.0
    args.real_tokens_per_token = 0.0
    with pytest.raises(ReplayError, match="--real-tokens-per-token must be > 0"):
        token_scale(args, {"block_tokens": 64, "tokens_per_block": 1})


def test_without_a_budget_every_server_gets_the_same_pools():
    args = _args("--servers", "stock", "tail_replay")
    specs, splits, lru_capacity = _plan(args)
    assert splits == [None, None] and lru_capacity == 262144
    assert _common_args(args)[-4:] == ["--max-total-tokens", "262144", "--max-mamba-cache-size", "32"]


@pytest.mark.parametrize("argv, match", [
    (["--equal-bytes-gib", "4", "--max-total-tokens", "1000"], "leave out --max-total-tokens"),
    (["--equal-bytes-gib", "0"], "must be > 0"),
    (["--equal-bytes-gib", "4", "--bytes-model", "llama"], "unknown model 'llama'"),
    (["--equal-bytes-gib", "4", "--servers", "stock --max-mamba-cache-size 4"], "contradicts --equal-bytes-gib"),
    (["--equal-bytes-gib", "4", "--servers", "stock --mamba-full-memory-ratio x"], "'x' is not a number"),
    (["--equal-bytes-gib", "0.1"], "raise --equal-bytes-gib"),
    (["--gpu", "tpu"], "unknown GPU 'tpu'"),
])
def test_bad_budgets_are_refused_by_name(argv, match):
    with pytest.raises(ReplayError, match=match):
        _plan(_args(*argv))


def test_spec_flags_reach_the_split():
    spec = parse_server_spec("stock --mamba-radix-cache-strategy no_buffer --mamba-full-memory-ratio 0.5")
    (_, split), = equal_bytes_specs([spec], [], QWEN3_NEXT, BUDGET, 1, [4])
    assert split.state_slots == 17 and "no_buffer" in split.rule and "0.5" in split.rule


def test_server_env_goes_to_its_spec_only_and_bad_ones_are_named():
    from eval.replay.runner import server_envs
    from eval.replay.servers import parse_server_specs

    specs = parse_server_specs(["stock", "stock_py=stock", "tail_replay"])
    args = build_parser().parse_args(["--out", "/tmp/unused", "--server-env", "stock_py",
                                      "SGLANG_UNIFIED_RADIX_TREE_CORE_BACKEND=python",
                                      "--server-env", "stock_py", "A=b=c"])
    assert server_envs(args.server_env, specs) == {
        "stock_py": {"SGLANG_UNIFIED_RADIX_TREE_CORE_BACKEND": "python", "A": "b=c"}}
    with pytest.raises(ReplayError, match="no server spec is labelled 'tr'"):
        server_envs([["tr", "A=1"]], specs)
    with pytest.raises(ReplayError, match="expected NAME=VALUE"):
        server_envs([["stock", "A"]], specs)
    with pytest.raises(ReplayError, match="expected NAME=VALUE"):
        server_envs([["stock", "1A=x"]], specs)


@pytest.mark.parametrize(("argv", "match"), [(["--request-rate", "0"], "--request-rate must be"),
                                             (["--request-rate", "inf"], "--request-rate must be"),
                                             (["--slo-s", "0"], "--slo-s must be > 0")])
def test_bad_open_loop_options_are_refused_by_name(argv, match):
    from eval.replay.runner import run

    with pytest.raises(ReplayError, match=match):
        run(build_parser().parse_args(["--out", "/tmp/unused", *argv]))
