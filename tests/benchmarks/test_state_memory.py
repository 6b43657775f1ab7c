"""Recurrent-state bytes per cached prefix checkpoint, SGLang's count against a hand computation."""

from __future__ import annotations

import pytest

from benchmarks import state_memory as memory

BF16, FP32 = 2, 4


@pytest.fixture(autouse=True)
def sglang_default_state_dtypes(monkeypatch):
    # SGLang's defaults: conv window bf16, SSM state fp32 (our launcher may export fp32 conv)
    monkeypatch.delenv("SGLANG_MAMBA_CONV_DTYPE", raising=False)
    monkeypatch.delenv("SGLANG_MAMBA_SSM_DTYPE", raising=False)


def _qwen3_next_by_hand(cfg: dict, tp: int = 1, conv_bytes: int = BF16) -> int:
    linear_layers = sum(1 for i in range(cfg["num_hidden_layers"]) if (i + 1) % cfg["full_attention_interval"])
    key_dim = cfg["linear_num_key_heads"] * cfg["linear_key_head_dim"]
    value_dim = cfg["linear_num_value_heads"] * cfg["linear_value_head_dim"]
    conv = (2 * key_dim + value_dim) // tp * (cfg["linear_conv_kernel_dim"] - 1)        # [q; k; v] window
    ssm = cfg["linear_num_value_heads"] // tp * cfg["linear_value_head_dim"] * cfg["linear_key_head_dim"]
    return linear_layers * (conv * conv_bytes + ssm * FP32)


def _nemotron_h_by_hand(cfg: dict) -> int:
    mamba_layers = cfg["hybrid_override_pattern"].count("M")
    heads, head_dim, state = cfg["mamba_num_heads"], cfg["mamba_head_dim"], cfg["ssm_state_size"]
    conv = (heads * head_dim + 2 * cfg["n_groups"] * state) * (cfg["conv_kernel"] - 1)  # [x; B; C] window
    return mamba_layers * (conv * BF16 + heads * head_dim * state * FP32)


def test_qwen3_next_80b_checkpoint_bytes_match_the_config():
    got = memory.qwen3_next_80b_state_bytes()
    assert got.linear_layers == 36
    assert got.conv_shape == (8192, 3) and got.ssm_shape == (32, 128, 128)
    assert (got.conv_dtype, got.ssm_dtype) == ("bfloat16", "float32")
    assert got.bytes_per_checkpoint == _qwen3_next_by_hand(memory.QWEN3_NEXT_80B) == 77_266_944
    print(f"Qwen3-Next-80B: {got.bytes_per_checkpoint:,} B = {got.mib_per_checkpoint:.2f} MiB per checkpoint")
    assert round(got.mib_per_checkpoint) == 74            # the figure quoted in the issue
    # pure Tail-Replay mode holds no state in the tree: the saving is the whole checkpoint
    assert got.tail_replay_bytes_per_prefix == 0
    assert got.saved_bytes_per_prefix == got.bytes_per_checkpoint


def test_tensor_parallel_shards_the_state():
    assert memory.qwen3_next_80b_state_bytes(tp=4).bytes_per_checkpoint == \
        _qwen3_next_by_hand(memory.QWEN3_NEXT_80B, tp=4)


def test_conv_dtype_follows_sglang_env(monkeypatch):
    monkeypatch.setenv("SGLANG_MAMBA_CONV_DTYPE", "float32")
    got = memory.qwen3_next_80b_state_bytes()
    assert got.conv_dtype == "float32"
    assert got.bytes_per_checkpoint == _qwen3_next_by_hand(memory.QWEN3_NEXT_80B, conv_bytes=FP32)


def test_nemotron_h_8b_checkpoint_bytes_match_the_config():
    got = memory.nemotron_h_8b_state_bytes()
    assert got.linear_layers == 24
    assert got.bytes_per_checkpoint == _nemotron_h_by_hand(memory.NEMOTRON_H_8B)


def test_linearkv_chunk_bytes_kv_only_against_with_states():
    """A 512-token chunk of Qwen3-Next-80B holds 12 attention layers x K and V [2 heads, 256] bf16
    per token (12 MiB) and, unless KV-only, a 74 MiB state: KV-only chunks fit 7x as many."""
    qwen, nemotron = memory.chunk_bytes(tp=1, chunk_tokens=512)
    assert (qwen.attention_layers, qwen.kv_bytes_per_token) == (12, 12 * 2 * 2 * 256 * BF16)
    assert qwen.kv_bytes == 12 * 2**20 and qwen.state_bytes == memory.qwen3_next_80b_state_bytes().bytes_per_checkpoint
    assert qwen.chunks_per_gib_kv_only == pytest.approx(2**30 / (12 * 2**20))
    assert qwen.chunks_per_gib_kv_only / qwen.chunks_per_gib_with_state == pytest.approx(
        (12 * 2**20 + qwen.state_bytes) / (12 * 2**20))
    assert (nemotron.attention_layers, nemotron.kv_bytes_per_token) == (4, 4 * 2 * 8 * 128 * BF16)
    # tensor parallelism shards the KV heads (never below one per rank)
    assert memory.chunk_bytes(tp=4)[0].kv_bytes_per_token == 12 * 2 * 1 * 256 * BF16
