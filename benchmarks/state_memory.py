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
see patches/tail_replay_sizing.py).

    python -m benchmarks.state_memory [--tp 1] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
from dataclasses import asdict, dataclass

#: Qwen3-Next-80B-A3B (the values from its config.json that size the recurrent state)
QWEN3_NEXT_80B = dict(
    num_hidden_layers=48, full_attention_interval=4, hidden_size=2048,
    linear_num_value_heads=32, linear_num_key_heads=16,
    linear_key_head_dim=128, linear_value_head_dim=128, linear_conv_kernel_dim=4,
)

#: Nemotron-H-8B (52 layers: 24 Mamba-2, 4 attention, 24 MLP)
NEMOTRON_H_8B = dict(
    hidden_size=4096,
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
        import patches

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


def _row(s: StateBytes) -> str:
    return (f"| {s.name} | {s.linear_layers} | {list(s.conv_shape)} {s.conv_dtype} | "
            f"{list(s.ssm_shape)} {s.ssm_dtype} | {s.bytes_per_checkpoint:,} B = {s.mib_per_checkpoint:.2f} MiB | "
            f"{s.tail_replay_bytes_per_prefix} B | {s.saved_bytes_per_prefix / 2**20:.2f} MiB |")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tp", type=int, default=1, help="attention tensor-parallel width (bytes per rank)")
    ap.add_argument("--json", action="store_true", help="print JSON instead of a markdown table")
    ns = ap.parse_args(argv)
    rows = [qwen3_next_80b_state_bytes(ns.tp), nemotron_h_8b_state_bytes(ns.tp)]
    if ns.json:
        print(json.dumps([{**asdict(r), "saved_bytes_per_prefix": r.saved_bytes_per_prefix} for r in rows],
                         indent=2))
        return
    print(f"Recurrent state per cached prefix checkpoint (SGLang's mamba_cache_per_req, attention TP {ns.tp}):")
    print("| model | linear layers | conv window / layer | SSM state / layer | SGLang per checkpoint "
          "| Tail-Replay (keep_checkpoints=false) | saved per cached prefix |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(_row(r))


if __name__ == "__main__":
    main()
