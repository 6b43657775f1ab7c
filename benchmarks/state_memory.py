"""Recurrent-state bytes SGLang holds per cached prefix checkpoint, and what Tail-Replay saves.

SGLang's hybrid radix cache keeps, for every tree node that holds a state checkpoint, one slot
of the recurrent-state pool: for each linear layer (GDN / Mamba-2) a conv window
[conv_dim, kernel - 1] and an SSM state [heads, head_dim, state_size]. The byte count per slot
is `config.mamba2_cache_params.mamba_cache_per_req`, computed here with SGLang's own config
classes and default dtypes (conv window bf16 unless SGLANG_MAMBA_CONV_DTYPE says otherwise,
SSM state fp32 unless SGLANG_MAMBA_SSM_DTYPE / the config's mamba_ssm_dtype says otherwise).

In pure Tail-Replay mode (`keep_checkpoints: false`) the tree stores no state at all, so the
saving per cached prefix is that whole number; the state pool then needs only the running
requests' own slots (one each, plus the ping-pong track slots of SGLang's `extra_buffer` strategy,
see patches/tail_replay/sizing.py).

LinearKV chunks: a registered chunk holds its attention KV and, unless it is KV-only
(state rules `zero` / `replay`, whose registrations keep no state), one state slot; the second
table is how many chunks of `--chunk-tokens` fit in a GiB either way. KV bytes per token follow
SGLang's MHA token pool: K and V of [kv_heads / tp, head_dim] per attention layer, in the KV
cache dtype (bf16 unless --kv-cache-dtype says otherwise).

    python -m benchmarks.state_memory [--tp 1] [--chunk-tokens 512] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
from dataclasses import asdict, dataclass

#: Qwen3-Next-80B-A3B (the values from its config.json that size the recurrent state)
QWEN3_NEXT_80B = dict(
    num_hidden_layers=48, full_attention_interval=4, hidden_size=2048,
    num_attention_heads=16, num_key_value_heads=2, head_dim=256,
    linear_num_value_heads=32, linear_num_key_heads=16,
    linear_key_head_dim=128, linear_value_head_dim=128, linear_conv_kernel_dim=4,
)

#: Nemotron-H-8B (52 layers: 24 Mamba-2, 4 attention, 24 MLP)
NEMOTRON_H_8B = dict(
    hidden_size=4096, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
    hybrid_override_pattern="M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M-",
    mamba_num_heads=128, mamba_head_dim=64, ssm_state_size=128, n_groups=8, conv_kernel=4,
)


@dataclass(frozen=True)
class StateBytes:
    name: str
    linear_layers: int
    conv_shape: tuple            # per layer, per slot
    ssm_shape: tuple             # per layer, per slot
    conv_dtype: str
    ssm_dtype: str
    bytes_per_checkpoint: int    # SGLang's mamba_cache_per_req
    tail_replay_bytes_per_prefix: int = 0   # keep_checkpoints=false: the tree holds no state

    @property
    def saved_bytes_per_prefix(self) -> int:
        return self.bytes_per_checkpoint - self.tail_replay_bytes_per_prefix

    @property
    def mib_per_checkpoint(self) -> float:
        return self.bytes_per_checkpoint / 2**20


def _import_sglang_configs():
    """SGLang's config classes; on a CPU-only machine the CPU patch set must come first."""
    os.environ.setdefault("SGLANG_USE_CPU_ENGINE", "1")
    import torch

    if not torch.cuda.is_available():
        from sglang_ext import patches

        patches.apply_patches("cpu")
    from sglang.srt.configs.nemotron_h import NemotronHConfig
    from sglang.srt.configs.qwen3_next import Qwen3NextConfig

    return Qwen3NextConfig, NemotronHConfig


def _state_bytes(name: str, config, tp: int) -> StateBytes:
    from sglang.srt.runtime_context import get_parallel

    # Outside a server nothing publishes the parallel layout: state it (attention TP width).
    with get_parallel().override(attn_tp_size=tp, tp_size=tp, moe_tp_size=tp, moe_ep_size=1, moe_dp_size=1,
                                 enable_cp_tp_group_sharing=False):
        params = config.mamba2_cache_params
        per_slot = params.mamba_cache_per_req
    conv = params.shape.conv
    return StateBytes(
        name=name, linear_layers=len(params.layers),
        conv_shape=tuple(conv[0]) if len(conv) == 1 else tuple(tuple(c) for c in conv),
        ssm_shape=tuple(params.shape.temporal),
        conv_dtype=str(params.dtype.conv).removeprefix("torch."),
        ssm_dtype=str(params.dtype.temporal).removeprefix("torch."),
        bytes_per_checkpoint=int(per_slot),
    )


def qwen3_next_80b_state_bytes(tp: int = 1) -> StateBytes:
    Qwen3NextConfig, _ = _import_sglang_configs()
    return _state_bytes("Qwen3-Next-80B-A3B", Qwen3NextConfig(**QWEN3_NEXT_80B), tp)


def nemotron_h_8b_state_bytes(tp: int = 1) -> StateBytes:
    _, NemotronHConfig = _import_sglang_configs()
    return _state_bytes("Nemotron-H-8B", NemotronHConfig(**NEMOTRON_H_8B), tp)


@dataclass(frozen=True)
class ChunkBytes:
    """What one registered LinearKV chunk of `chunk_tokens` tokens holds on one rank."""

    name: str
    attention_layers: int
    kv_bytes_per_token: int
    state_bytes: int             # one state slot (SGLang's mamba_cache_per_req)
    chunk_tokens: int

    @property
    def kv_bytes(self) -> int:
        return self.kv_bytes_per_token * self.chunk_tokens

    @property
    def chunks_per_gib_with_state(self) -> float:
        return 2**30 / (self.kv_bytes + self.state_bytes)

    @property
    def chunks_per_gib_kv_only(self) -> float:
        return 2**30 / self.kv_bytes


def kv_bytes_per_token(config, attention_layers: int, tp: int = 1, dtype_bytes: int = 2) -> int:
    """SGLang's MHA token pool: K and V [max(1, kv_heads / tp), head_dim] per attention layer."""
    heads = max(1, config.num_key_value_heads // tp)
    return attention_layers * 2 * heads * config.head_dim * dtype_bytes


def chunk_bytes(tp: int = 1, chunk_tokens: int = 512) -> list[ChunkBytes]:
    Qwen3NextConfig, NemotronHConfig = _import_sglang_configs()
    qwen, nemotron = Qwen3NextConfig(**QWEN3_NEXT_80B), NemotronHConfig(**NEMOTRON_H_8B)
    rows = []
    for state, config, layers in (
            (qwen3_next_80b_state_bytes(tp), qwen, len(qwen.full_attention_layer_ids)),
            (nemotron_h_8b_state_bytes(tp), nemotron, NEMOTRON_H_8B["hybrid_override_pattern"].count("*"))):
        rows.append(ChunkBytes(state.name, layers, kv_bytes_per_token(config, layers, tp), state.bytes_per_checkpoint,
                               chunk_tokens))
    return rows


def _chunk_row(c: ChunkBytes) -> str:
    return (f"| {c.name} | {c.attention_layers} | {c.kv_bytes_per_token:,} B | {c.kv_bytes / 2**20:.2f} MiB | "
            f"{c.state_bytes / 2**20:.2f} MiB | {c.chunks_per_gib_with_state:.1f} | {c.chunks_per_gib_kv_only:.1f} | "
            f"{c.chunks_per_gib_kv_only / c.chunks_per_gib_with_state:.1f}x |")


def _row(s: StateBytes) -> str:
    return (f"| {s.name} | {s.linear_layers} | {list(s.conv_shape)} {s.conv_dtype} | "
            f"{list(s.ssm_shape)} {s.ssm_dtype} | {s.bytes_per_checkpoint:,} B = {s.mib_per_checkpoint:.2f} MiB | "
            f"{s.tail_replay_bytes_per_prefix} B | {s.saved_bytes_per_prefix / 2**20:.2f} MiB |")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tp", type=int, default=1, help="attention tensor-parallel width (bytes per rank)")
    ap.add_argument("--chunk-tokens", type=int, default=512, help="LinearKV chunk length for the chunk table")
    ap.add_argument("--json", action="store_true", help="print JSON instead of a markdown table")
    ns = ap.parse_args(argv)
    rows = [qwen3_next_80b_state_bytes(ns.tp), nemotron_h_8b_state_bytes(ns.tp)]
    chunks = chunk_bytes(ns.tp, ns.chunk_tokens)
    if ns.json:
        print(json.dumps({"states": [{**asdict(r), "saved_bytes_per_prefix": r.saved_bytes_per_prefix} for r in rows],
                          "chunks": [{**asdict(c), "kv_bytes": c.kv_bytes,
                                      "chunks_per_gib_with_state": c.chunks_per_gib_with_state,
                                      "chunks_per_gib_kv_only": c.chunks_per_gib_kv_only} for c in chunks]},
                         indent=2))
        return
    print(f"Recurrent state per cached prefix checkpoint (SGLang's mamba_cache_per_req, attention TP {ns.tp}):")
    print("| model | linear layers | conv window / layer | SSM state / layer | SGLang per checkpoint "
          "| Tail-Replay (keep_checkpoints=false) | saved per cached prefix |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(_row(r))
    print()
    print(f"LinearKV chunks of {ns.chunk_tokens} tokens (attention TP {ns.tp}, bf16 KV):")
    print("| model | attention layers | KV / token | KV / chunk | state / chunk | chunks per GiB with states "
          "| chunks per GiB KV-only (`replay`, `zero`) | KV-only / with states |")
    print("|---|---|---|---|---|---|---|---|")
    for c in chunks:
        print(_chunk_row(c))


if __name__ == "__main__":
    main()
