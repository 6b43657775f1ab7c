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
