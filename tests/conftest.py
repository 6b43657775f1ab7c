"""Shared helpers for the test suite: tiny checkpoints are built once per session."""

from __future__ import annotations

from pathlib import Path

import pytest

from eval.fixtures.tiny import build_tiny_model


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
