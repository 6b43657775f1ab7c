"""CPU: size the memory pools from the memory seen before the model loaded, not from what other
processes happened to leave free after it.

Target (SGLang 0.5.23): `srt/mem_cache/kv_cache_configurator.py::KVCacheConfigurator.
_profile_available_bytes`. It budgets `free memory now - (1 - mem_fraction_static) x free memory
before the model loaded`, which on a GPU charges the loaded weights against the static fraction.
On a CPU "free memory" is the whole machine's: when other processes (another server booting beside
this one, a test run, a neighbour's job) take more than `1 - mem_fraction_static` of it meanwhile,
SGLang refuses to start ("Loaded weights leave no GPU memory for the KV cache"), however small the
model. On that refusal this patch profiles once more as if free memory had not moved (the
pre-load figure), so the budget is `mem_fraction_static x` the memory free at start; the pools are
still capped by `--max-total-tokens` / `--max-mamba-cache-size`, which the CPU launcher sets.
"""

from __future__ import annotations

import functools
import logging

logger = logging.getLogger(__name__)

TARGET = "srt/mem_cache/kv_cache_configurator.py: KVCacheConfigurator._profile_available_bytes"
REFUSAL = "leave no GPU memory for the KV cache"


def _wrap(original, module):
    @functools.wraps(original)
    def _profile_available_bytes(self, pre_model_load_memory):
        try:
            return original(self, pre_model_load_memory)
        except ValueError as exc:
            if REFUSAL not in str(exc):
                raise
        logger.warning("CPU: free memory fell by more than the non-static share while the model loaded "
                       "(other processes); budgeting from the %.2f GB free before loading", pre_model_load_memory)
        measure = module.get_available_gpu_memory
        module.get_available_gpu_memory = lambda *args, **kwargs: pre_model_load_memory
        try:
            return original(self, pre_model_load_memory)
        finally:
            module.get_available_gpu_memory = measure

    return _profile_available_bytes


def apply() -> None:
    from sglang.srt.mem_cache import kv_cache_configurator as module

    cls = module.KVCacheConfigurator
    cls._profile_available_bytes = _wrap(cls._profile_available_bytes, module)
