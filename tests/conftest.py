"""Shared helpers for the test suite: tiny checkpoints are built once per session.

CPU servers started by the suite fork their children from the launcher
(`SGLANG_EXT_CPU_START_METHOD=fork`, sglang_ext/env.py): a server is ready sooner, since its
scheduler and detokenizer do not import SGLang again (benchmarks/start_method.py). The path SGLang takes on
GPUs, spawned children that re-apply the patches, is kept by the module that passes
`tests.e2e.serving.SPAWN_ENV` (the Qwen3-Next server, checked against transformers, which also
checks that its children were not forked). A caller's own setting of the variable wins.

`scripts/test.sh` runs the suite on two pytest-xdist workers (a module per worker at a time); each
worker then computes with one thread and its servers get `SGLANG_EXT_CPU_THREADS=1`, so the two
workers' OpenMP threads do not wait on each other's cores.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from eval.fixtures.tiny import build_tiny_model
from sglang_ext.env import CPU_START_METHOD_VAR, CPU_THREADS_VAR

os.environ.setdefault(CPU_START_METHOD_VAR, "fork")
if os.environ.get("PYTEST_XDIST_WORKER"):
    # two workers share the cores: one compute thread per server and per worker, or their OpenMP
    # threads wait on each other's cores
    import torch

    os.environ.setdefault(CPU_THREADS_VAR, "1")
    torch.set_num_threads(1)


#: the modules that take longest (set-up and calls summed, a run of `scripts/test.sh
#: --durations=0` in the work tree on 2026-12-07, 13 to 129 s each), longest first. The workers
#: take modules in collection order (`--no-loadscope-reorder`), so these go first and the short
#: ones fill the end of both workers' queues, instead of a long server module starting last
#: while the other worker idles. The other modules follow in their collection order; a module
#: missing here only runs later.
LONGEST_FIRST = (
    "tests/quality/test_quality_server.py",
    "tests/e2e/test_exactness_fuzz.py",
    "tests/e2e/test_request_hardening.py",
    "tests/e2e/test_linearkv_server.py",
    "tests/e2e/test_tail_replay_storage.py",
    "tests/scale/test_cluster_server.py",
    "tests/e2e/test_tail_replay_server.py",
    "tests/trained/test_trained_models.py",
    "tests/e2e/test_qwen3_next_server.py",
    "tests/e2e/test_sae_server.py",
    "tests/e2e/test_tail_replay_hicache.py",
    "tests/e2e/test_tail_replay_extra_buffer.py",
    "tests/e2e/test_tail_replay_load.py",
    "tests/e2e/test_tail_replay_auto_budget.py",
    "tests/e2e/test_nemotron_h_server.py",
    "tests/e2e/test_default_dtype_server.py",
    "tests/replay/test_replay_live.py",
    "tests/e2e/test_tail_replay_pressure.py",
    "tests/e2e/test_sae_states.py",
    "tests/e2e/test_tail_replay_byte_budget.py",
    "tests/training/test_train_resume.py",
    "tests/patches/test_cpu_deterministic.py",
    "tests/e2e/test_linearkv_rag_example.py",
    "tests/e2e/test_proportioned_fixture_server.py",
    "tests/e2e/test_hicache_server.py",
)


def pytest_collection_modifyitems(config, items):
    """Longest modules first (`LONGEST_FIRST`); a stable sort keeps each module's own order."""
    rank = {path: i for i, path in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.nodeid.split("::", 1)[0], len(rank)))


@pytest.fixture(scope="session")
def tiny_model_factory(tmp_path_factory):
    """`make(arch, layout=None) -> Path`: a tiny random checkpoint, built once per session."""
    built: dict[tuple[str, str | None], Path] = {}

    def make(arch: str, layout: str | None = None) -> Path:
        key = (arch, layout)
        if key not in built:
            out = tmp_path_factory.mktemp(f"{arch}-{layout or 'default'}")
            built[key] = build_tiny_model(arch, out, seed=0, layout=layout)
        return built[key]

    return make
