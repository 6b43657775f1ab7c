"""Tail-Replay's public face: `patches/` and the rest of the product reach the wing only through
`sglang_ext.tail_replay`, importing it loads none of SGLang's unified-cache modules, and the
environment module does not import the wing back."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import sglang_ext.tail_replay as face

ROOT = Path(__file__).resolve().parents[2]
WING = "sglang_ext.tail_replay"


def _imported_modules(path: Path) -> list[tuple[int, str]]:
    """(line, module) of every import in `path`, including those inside functions."""
    out = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            out += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out.append((node.lineno, node.module))
    return out


def _outside_the_wing() -> list[Path]:
    """Every product and evaluation file outside the wing: the patches (top-level `patches/`), the
    top-level modules, the other wings (subpackages), eval and benchmarks."""
    wing = ROOT / "sglang_ext" / "tail_replay"
    product = [*sorted((ROOT / "patches").rglob("*.py")),
               *sorted(p for p in (ROOT / "sglang_ext").rglob("*.py") if wing not in p.parents),
               *sorted((ROOT / "eval").rglob("*.py")), *sorted((ROOT / "benchmarks").rglob("*.py"))]
    assert any(p.parent.name == "tail_replay" and "patches" in p.parts for p in product)   # the scan sees the patches
    assert any("linearkv" in p.parts for p in product)                # and the other wings
    return product


def test_patches_and_the_product_import_only_the_wings_face():
    offenders = [f"{path.relative_to(ROOT)}:{line}: {module}"
                 for path in _outside_the_wing() for line, module in _imported_modules(path)
                 if module.startswith(WING + ".")]
    assert not offenders, "import from `sglang_ext.tail_replay`, not its modules:\n" + "\n".join(offenders)


def test_the_environment_module_does_not_import_the_wing():
    modules = [module for _, module in _imported_modules(ROOT / "sglang_ext" / "env.py")]
    assert not [m for m in modules if m.startswith(WING)], modules


def test_importing_the_face_loads_no_sglang_cache_module():
    code = ("import sys, sglang_ext.tail_replay as t; t.record_of; t.BACKEND_NAME; "
            "print(sorted(m for m in sys.modules if m.startswith('sglang.')))")
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "[]", result.stdout   # no SGLang module at all, so no unified cache


def test_the_face_serves_the_cache_adapter_on_first_use():
    from sglang_ext.tail_replay import cache

    assert face.tail_replay_cache_factory is cache.tail_replay_cache_factory
    assert face.TailReplayRadixCache is cache.TailReplayRadixCache


def test_every_exported_name_exists():
    missing = [name for name in face.__all__ if name not in face._FROM_CACHE and not hasattr(face, name)]
    assert not missing
