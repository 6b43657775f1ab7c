"""The CPU memory budget falls back to the pre-load free memory only when SGLang's profile refuses
because other processes took memory meanwhile (patches/cpu/memory_budget.py)."""

from __future__ import annotations

import types

import pytest

from sglang_ext.patches.cpu.memory_budget import REFUSAL, _wrap

FRACTION = 0.1


def _configurator(free_now: float):
    """A stand-in module + SGLang-shaped profile: budget = free now - (1 - fraction) x free before."""
    module = types.SimpleNamespace(get_available_gpu_memory=lambda *a, **k: free_now)

    def profile(self, pre):
        rest = module.get_available_gpu_memory("cpu", 0) - pre * (1 - FRACTION)
        if rest <= 0:
            raise ValueError(f"Loaded weights {REFUSAL} under --mem-fraction-static={FRACTION}")
        return int(rest * (1 << 30))

    return module, _wrap(profile, module)


def test_a_quiet_machine_keeps_sglangs_budget():
    module, profile = _configurator(free_now=19.5)
    assert profile(None, 20.0) == int((19.5 - 18.0) * (1 << 30))


def test_memory_taken_by_others_falls_back_to_the_preload_figure():
    module, profile = _configurator(free_now=12.0)            # a neighbour took 8 GB
    assert profile(None, 20.0) == int(20.0 * FRACTION * (1 << 30))
    assert module.get_available_gpu_memory() == 12.0           # the measurement is restored


def test_other_errors_pass_through():
    module = types.SimpleNamespace(get_available_gpu_memory=lambda *a, **k: 1.0)

    def profile(self, pre):
        raise ValueError("something else")

    with pytest.raises(ValueError, match="something else"):
        _wrap(profile, module)(None, 20.0)
