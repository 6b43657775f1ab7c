"""The linear layers' conv-window state in the dtype the model runs in, unless the user chose one.

Targets (SGLang 0.5.23) `srt/environ.py: Envs.SGLANG_MAMBA_CONV_DTYPE` (its default), read by
`srt/configs/mamba_utils.py::mamba2_state_dtype` (~line 68), and
`srt/configs/model_config.py::ModelConfig.__init__` (~line 881, where the model's dtype is decided).

`mamba2_state_dtype` takes the conv-state dtype from `SGLANG_MAMBA_CONV_DTYPE`, whose default is a
fixed "bfloat16", whatever dtype the model runs in (`--dtype`; with the default "auto" the
checkpoint's, where float32 checkpoints run in float16). Every linear-state pool (MambaPool, its
ping-pong and checkpoint buffers, the host pool) allocates its conv buffers in that dtype, for GDN
(Qwen3-Next) and Mamba-2 (Nemotron-H, Falcon-H1, ...) models alike. The conv kernels cast, but the
`extra_buffer` strategy's tracking copy in prefill does not: `conv_states[conv_states_mask_indices] =
activations` (`srt/layers/attention/linear/gdn_backend.py::forward_extend` ~line 1066,
`srt/layers/attention/mamba/mamba.py` ~line 586) is an index put, which needs equal dtypes, so a
server of any model not running in bfloat16 dies on its first prefill ("Index put requires the
source and destination dtypes match"), on a GPU as on the CPU. (The CPU launcher used to avoid it
only when `--dtype` was given, by exporting that dtype as `SGLANG_MAMBA_CONV_DTYPE`.)

The fix decides the dtype where SGLang decides it: the variable's default becomes the dtype of the
model this process last configured (recorded when a `ModelConfig` is built; the scheduler builds
its own before it sizes any pool), as vLLM's conv-state dtype "auto" does. An explicit
`SGLANG_MAMBA_CONV_DTYPE` still wins (with a warning when it differs from the model's dtype,
which `extra_buffer` cannot serve); before any `ModelConfig` exists the default stays "bfloat16".
"""

from __future__ import annotations

import functools
import logging

logger = logging.getLogger(__name__)

TARGET = ("srt/environ.py: Envs.SGLANG_MAMBA_CONV_DTYPE (default, read by "
          "srt/configs/mamba_utils.py::mamba2_state_dtype); srt/configs/model_config.py: ModelConfig.__init__")
#: SGLang 0.5.23's fixed default, replaced here
STOCK_DEFAULT = "bfloat16"

_model_dtype: list[str] = []   # the dtype of the model last configured in this process (0 or 1 name)


def _dtype_name(dtype) -> str | None:
    """The `SGLANG_MAMBA_CONV_DTYPE` spelling of a torch dtype (None for one it does not accept)."""
    import torch

    return {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}.get(dtype)


def conv_dtype_default() -> str:
    """`SGLANG_MAMBA_CONV_DTYPE`'s default: the configured model's dtype, else SGLang's own."""
    return _model_dtype[0] if _model_dtype else STOCK_DEFAULT


def record_model_dtype(dtype) -> None:
    name = _dtype_name(dtype)
    if name is None:
        return
    _model_dtype[:] = [name]
    from sglang.srt.environ import envs

    field = envs.SGLANG_MAMBA_CONV_DTYPE
    if field.is_set() and field.get() != name:
        logger.warning("%s=%s differs from the model's dtype %s: the extra_buffer Mamba radix-cache "
                       "strategy needs them equal (unset it to store conv states in %s)",
                       field.name, field.get(), name, name)


def _wrap_init(original):
    @functools.wraps(original)
    def __init__(self, *args, **kwargs):
        original(self, *args, **kwargs)
        record_model_dtype(getattr(self, "dtype", None))

    __init__._sglang_ext_patched = True
    return __init__


def apply() -> None:
    from sglang.srt.configs.model_config import ModelConfig
    from sglang.srt.environ import envs

    field = envs.SGLANG_MAMBA_CONV_DTYPE
    if field.default is conv_dtype_default:
        return
    if field.default != STOCK_DEFAULT:   # another SGLang (SGLANG_EXT_ALLOW_OTHER_SGLANG): leave its choice
        logger.warning("sglang_ext: %s: default %r is not %r; conv-state dtype left to SGLang",
                       TARGET, field.default, STOCK_DEFAULT)
        return
    field.default = conv_dtype_default   # EnvField resolves a callable default on each unset read
    if not getattr(ModelConfig.__init__, "_sglang_ext_patched", False):
        ModelConfig.__init__ = _wrap_init(ModelConfig.__init__)
