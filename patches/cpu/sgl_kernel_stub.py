"""Stand-in for the `sgl_kernel` package on machines where its compiled library cannot load.

Targets: `sgl_kernel/__init__.py` (sglang-kernel 0.4.10, pinned by SGLang 0.5.23), which
loads a CUDA library at import time and fails without libcuda. SGLang's CPU engine imports
CPU ops from it at import time (`kernels/ops/kvcache/cache_move.py`,
`srt/mem_cache/allocation.py`, `srt/layers/attention/linear/*`).

The stand-in is a package whose `__path__` is the real one, so sgl_kernel's own Python
wrappers (e.g. `sgl_kernel.mamba.chunk_gated_delta_rule_cpu`) load unchanged; only the
compiled `torch.ops.sgl_kernel.*_cpu` ops are provided, in pure torch (`patches/cpu/ops`).
A top-level name is looked up in sgl_kernel's submodules; anything without a CPU op fails
with an error naming it.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
import types
from pathlib import Path

import torch

from sglang_ext.patches.cpu.ops import conv1d, gdn, memory, sampling

TARGET = "sgl_kernel/__init__.py (sglang-kernel 0.4.10)"

#: torch.ops.sgl_kernel.<name> -> pure-torch implementation
CPU_OPS = {
    "causal_conv1d_fwd_cpu": conv1d.causal_conv1d_fwd_cpu,
    "causal_conv1d_update_cpu": conv1d.causal_conv1d_update_cpu,
    "chunk_gated_delta_rule_cpu": gdn.chunk_gated_delta_rule_cpu,
    "fused_gdn_gating_cpu": gdn.fused_gdn_gating_cpu,
    "fused_sigmoid_gating_delta_rule_update_cpu": gdn.fused_sigmoid_gating_delta_rule_update_cpu,
    "assign_req_to_token_pool_cpu": memory.assign_req_to_token_pool_cpu,
    "copy_all_layer_kv_cache_cpu": memory.copy_all_layer_kv_cache_cpu,
    "murmur_hash32_cpu": sampling.murmur_hash32_op,   # seeded sampling (deterministic inference)
}

#: submodules searched for `from sgl_kernel import X`
_WRAPPER_MODULES = ("speculative", "kvcacheio", "mamba", "memory")


class MissingCPUKernel(ImportError):
    pass


def _real_package_dir() -> Path:
    spec = importlib.util.find_spec("sgl_kernel")
    if spec is None or not spec.submodule_search_locations:
        raise MissingCPUKernel("sgl_kernel (sglang-kernel) is not installed; SGLang needs it")
    return Path(list(spec.submodule_search_locations)[0])


def _module_getattr(name: str):
    if name.startswith("__"):
        raise AttributeError(name)
    for sub in _WRAPPER_MODULES:
        module = importlib.import_module(f"sgl_kernel.{sub}")
        if hasattr(module, name):
            return getattr(module, name)
    raise MissingCPUKernel(
        f"sgl_kernel.{name} has no CPU fallback in sglang_ext (SGLang called a GPU-only kernel "
        "on the CPU path; please report the flag or model that reached it)"
    )


def _register_torch_ops() -> None:
    namespace = torch.ops.sgl_kernel
    for name, fn in CPU_OPS.items():
        setattr(namespace, name, fn)


def _real_sgl_kernel_loads() -> bool:
    if not torch.cuda.is_available():
        return False
    try:
        importlib.import_module("sgl_kernel")
        return True
    except ImportError:
        return False


def apply() -> None:
    if "sgl_kernel" in sys.modules and not getattr(sys.modules["sgl_kernel"], "_sglang_ext_stub", False):
        return  # the real package is already loaded
    if _real_sgl_kernel_loads():
        return
    stub = types.ModuleType("sgl_kernel")
    stub.__path__ = [str(_real_package_dir())]
    stub.__getattr__ = _module_getattr
    stub._sglang_ext_stub = True
    stub.__version__ = importlib.import_module("importlib.metadata").version("sglang-kernel")
    sys.modules["sgl_kernel"] = stub
    _register_torch_ops()
