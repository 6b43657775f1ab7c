"""The policy core must stay importable without SGLang or torch."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_policy_core_imports_neither_sglang_nor_torch():
    code = ("import sys, sglang_ext.eviction as e; "
            "bad = [m for m in ('sglang', 'torch') if m in sys.modules]; "
            "assert not bad, bad; print(sorted(e.POLICY_REGISTRY))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                         check=True)
    assert "'sae'" in out.stdout and "'belady'" in out.stdout
    assert "'sae-model'" not in out.stdout  # ablations are registered by the simulator only
