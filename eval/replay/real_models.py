"""The real models and GPUs a replay of the tiny fixture is priced in (frozen tables, no SGLang).

`MODELS`: per model, the bytes its pools hold (one token's attention KV, one recurrent-state slot)
and what its prefill computes (active parameters, full-attention shape), each derived from the
model's Hugging Face `config.json` as written in `source`. `GPUS`: peak dense bf16 FLOP/s and
HBM bandwidth from the vendor's datasheet. docs/gpu_ttft_model.md states how they are used.
"""

from __future__ import annotations

from dataclasses import dataclass

MIB = 1 << 20


@dataclass(frozen=True)
class RealModel:
    """One model as deployed (dtype, tensor parallelism). Bytes are per GPU at that TP.

    kv_bytes_per_token: attention KV of one token over all full-attention layers;
    state_bytes_per_slot: one recurrent-state slot (every linear layer's SSM state and conv state);
    active_params / total_params: matmul parameters a token goes through / the model holds;
    attn_layers, q_heads, head_dim: the full-attention layers' shape (attention FLOPs);
    bytes_per_param: weight dtype."""

    name: str
    hf_id: str
    kv_bytes_per_token: int
    state_bytes_per_slot: int
    active_params: float
    total_params: float
    attn_layers: int
    q_heads: int
    head_dim: int
    bytes_per_param: int
    source: str

    @property
    def slot_in_kv_tokens(self) -> float:
        """One state slot's bytes in tokens of KV: the real ratio the fixture is scaled by."""
        return self.state_bytes_per_slot / self.kv_bytes_per_token


def _gdn_state_bytes(linear_layers: int, v_heads: int, k_dim: int, v_dim: int, k_heads: int,
                     conv_kernel: int, ssm_bytes: int = 4, conv_bytes: int = 2) -> int:
    """Gated DeltaNet slot: per linear layer an SSM state v_heads x k_dim x v_dim (float32, SGLang's
    default --mamba-ssm-dtype) and a conv state (conv_kernel - 1) x (2 k_heads k_dim + v_heads v_dim)
    in the model dtype (bf16)."""
    ssm = v_heads * k_dim * v_dim * ssm_bytes
    conv = (conv_kernel - 1) * (2 * k_heads * k_dim + v_heads * v_dim) * conv_bytes
    return linear_layers * (ssm + conv)


MODELS: dict[str, RealModel] = {m.name: m for m in (
    RealModel(
        name="qwen3-next-80b-a3b", hf_id="Qwen/Qwen3-Next-80B-A3B-Instruct",
        # 48 layers, full_attention_interval 4 -> 12 full-attention layers; 2 KV heads x head_dim 256;
        # K and V in bf16: 12 * 2 * 2 * 256 * 2 B = 24,576 B = 24 KiB
        kv_bytes_per_token=12 * 2 * 2 * 256 * 2,
        # 36 GDN layers; linear_num_value_heads 32, linear_num_key_heads 16, key/value head dim 128,
        # linear_conv_kernel_dim 4: 36 * (2 MiB SSM + 48 KiB conv) = 77,266,944 B = 73.69 MiB
        state_bytes_per_slot=_gdn_state_bytes(36, 32, 128, 128, 16, 4),
        active_params=3.0e9, total_params=80.0e9,      # "80B-A3B": 80B held, 3B activated per token
        attn_layers=12, q_heads=16, head_dim=256, bytes_per_param=2,
        source="HF config.json of Qwen/Qwen3-Next-80B-A3B-Instruct (num_hidden_layers 48, "
               "full_attention_interval 4, num_key_value_heads 2, head_dim 256, num_attention_heads 16, "
               "linear_num_value_heads 32, linear_num_key_heads 16, linear_key/value_head_dim 128, "
               "linear_conv_kernel_dim 4); bf16 KV and conv state, float32 SSM state; TP 1"),
    # Calibration models (the Tail-Replay paper's H100 full-prefill times): the Qwen3.5 layout,
    # one full-attention layer in four, 4 KV heads x 256; parameters by the model's name.
    RealModel(
        name="qwen3.5-4b", hf_id="Qwen/Qwen3.5-4B",
        kv_bytes_per_token=8 * 2 * 4 * 256 * 2,
        state_bytes_per_slot=_gdn_state_bytes(24, 32, 128, 128, 16, 4),
        active_params=4.0e9, total_params=4.0e9,
        attn_layers=8, q_heads=16, head_dim=256, bytes_per_param=2,
        source="Qwen3.5 family layout (32 layers, 8 full-attention, 16 query / 4 KV heads x 256); "
               "4.0e9 parameters by name; used for calibration only"),
    RealModel(
        name="qwen3.6-27b", hf_id="Qwen/Qwen3.6-27B",
        kv_bytes_per_token=16 * 2 * 4 * 256 * 2,
        state_bytes_per_slot=_gdn_state_bytes(48, 48, 128, 128, 16, 4),
        active_params=27.0e9, total_params=27.0e9,
        attn_layers=16, q_heads=24, head_dim=256, bytes_per_param=2,
        source="Qwen3.5-27B layout (64 layers, hidden 5120, 16 full-attention, 24 query / 4 KV heads "
               "x 256), assumed for Qwen3.6-27B; 27e9 parameters by name; used for calibration only"),
)}


@dataclass(frozen=True)
class Gpu:
    name: str
    peak_bf16_flops: float       # dense (no sparsity) tensor-core bf16 FLOP/s
    hbm_bytes_per_s: float
    source: str


GPUS: dict[str, Gpu] = {g.name: g for g in (
    Gpu("h100-sxm", 989.4e12, 3.35e12,
        "NVIDIA H100 Tensor Core GPU datasheet, SXM5: bf16 1,979 TFLOPS with sparsity (989.4 dense), "
        "HBM3 3.35 TB/s"),
    Gpu("h200", 989.4e12, 4.8e12,
        "NVIDIA H200 Tensor Core GPU datasheet, SXM: bf16 1,979 TFLOPS with sparsity (989.4 dense), "
        "HBM3e 4.8 TB/s"),
)}


def real_model(name: str) -> RealModel:
    """The table's entry; a ValueError naming the choices for an unknown name."""
    if name not in MODELS:
        raise ValueError(f"unknown model {name!r}; known: {', '.join(MODELS)}")
    return MODELS[name]


def gpu(name: str) -> Gpu:
    if name not in GPUS:
        raise ValueError(f"unknown GPU {name!r}; known: {', '.join(GPUS)}")
    return GPUS[name]
