"""State slots per running request (`patches/tail_replay/sizing.py`) for every Mamba strategy.

SGLang's `_calculate_mamba_ratio` reads the published server config; here its readers are
replaced by plain namespaces, and SGLang's own `resolve_max_num_reqs` turns the ratio into the
number of running requests `--max-mamba-cache-size` admits.
"""

from __future__ import annotations

import json
import os

os.environ.setdefault("SGLANG_USE_CPU_ENGINE", "1")

from sglang_ext import patches  # noqa: E402

patches.apply_patches("cpu")  # before any SGLang import

from contextlib import contextmanager  # noqa: E402
from types import SimpleNamespace  # noqa: E402
from unittest import mock  # noqa: E402

import pytest  # noqa: E402
from sglang.srt import runtime_context  # noqa: E402
from sglang.srt.mem_cache import kv_cache_configurator as kvc  # noqa: E402

from sglang_ext.env import TAIL_REPLAY_CONFIG_VAR  # noqa: E402
from sglang_ext.patches.tail_replay.sizing import state_slots_per_request  # noqa: E402

#: strategy -> (--mamba-radix-cache-strategy, overlap scheduler on)
STRATEGIES = {
    "no_buffer": ("no_buffer", False),
    "extra_buffer": ("extra_buffer", False),
    "extra_buffer+overlap": ("extra_buffer", True),
    "extra_buffer_lazy+overlap": ("extra_buffer_lazy", True),
}
#: SGLang's own reservation (3 + ping-pong slots), untouched by the patch
STOCK_RATIO = {"no_buffer": 3, "extra_buffer": 4, "extra_buffer+overlap": 5, "extra_buffer_lazy+overlap": 4}
#: Tail-Replay without checkpoints: the request's state + its ping-pong slots (lazy: both)
NO_STATES_RATIO = {"no_buffer": 1, "extra_buffer": 2, "extra_buffer+overlap": 3, "extra_buffer_lazy+overlap": 3}


@contextmanager
def server_config(strategy: str, backend: str | None, tail_replay_config: dict | None = None,
                  max_mamba_cache_size: int = 6, max_running_requests: int | None = None):
    name, overlap = STRATEGIES[strategy]
    memory = SimpleNamespace(radix_cache_backend=backend, disable_radix_cache=False)
    mamba = SimpleNamespace(enable_mamba_extra_buffer=name != "no_buffer",
                            enable_mamba_extra_buffer_lazy=name == "extra_buffer_lazy")
    schedule = SimpleNamespace(disable_overlap_schedule=not overlap, max_mamba_cache_size=max_mamba_cache_size,
                               max_running_requests=max_running_requests)
    readers = {"get_memory": lambda: memory, "get_exec": lambda: SimpleNamespace(mamba=mamba),
               "get_schedule": lambda: schedule}
    env = {TAIL_REPLAY_CONFIG_VAR: json.dumps(tail_replay_config or {})}
    with mock.patch.multiple(kvc, **readers), mock.patch.multiple(runtime_context, **readers), \
            mock.patch.dict(os.environ, env):
        yield


def ratio() -> int:
    return kvc.KVCacheConfigurator._calculate_mamba_ratio(SimpleNamespace())


def admitted_requests(token_capacity: int = 65536) -> int:
    """SGLang's own `resolve_max_num_reqs` on a configurator reduced to what it reads."""
    configurator = SimpleNamespace(model_config=SimpleNamespace(context_len=65536), attn_dp_size=1,
                                   mambaish_config=object(), _calculate_mamba_ratio=ratio)
    return kvc.KVCacheConfigurator.resolve_max_num_reqs(configurator, token_capacity)


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_without_checkpoints_a_request_holds_its_state_and_its_ping_pong_slots(strategy):
    with server_config(strategy, "tail_replay", {"keep_checkpoints": False}):
        assert ratio() == NO_STATES_RATIO[strategy]
        assert admitted_requests() == 6 // NO_STATES_RATIO[strategy]


@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("backend, config", [(None, None), ("tail_replay", {"keep_checkpoints": True}),
                                             ("tail_replay", {})])
def test_with_checkpoints_sglang_sizes_the_pool(strategy, backend, config):
    with server_config(strategy, backend, config):
        assert ratio() == STOCK_RATIO[strategy]


def test_pure_sizing_function_matches_sglang_ping_pong_buffer():
    # HybridReqToTokenPool's ping-pong buffer: 2 entries with overlap, 1 without
    assert state_slots_per_request(extra_buffer=False, overlap=True) == 1
    assert state_slots_per_request(extra_buffer=True, overlap=False) == 2
    assert state_slots_per_request(extra_buffer=True, overlap=True) == 3


def test_a_max_running_requests_below_the_cap_is_kept():
    with server_config("extra_buffer+overlap", "tail_replay", {"keep_checkpoints": False},
                       max_mamba_cache_size=12, max_running_requests=3):
        assert admitted_requests() == 3
