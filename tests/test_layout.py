"""The package layout's one-way dependencies: product <- eval <- training.

- `sglang_ext/` and `patches/` (what a user installs to serve) import nothing from `eval`,
  `benchmarks` or `tests`;
- `eval/` outside `eval/training/` never imports `eval.training` (training -> eval, not back);
- our top-level `kernels/` folder never shadows the `kernels` package SGLang depends on.
"""

from __future__ import annotations

import ast
import importlib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _imports(path: Path) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
    return names


def _offenders(folders: tuple[str, ...], banned: tuple[str, ...], skip: str | None = None) -> dict[str, list[str]]:
    found: dict[str, list[str]] = {}
    for folder in folders:
        for path in sorted((ROOT / folder).rglob("*.py")):
            rel = path.relative_to(ROOT).as_posix()
            if skip and rel.startswith(skip):
                continue
            bad = sorted(n for n in _imports(path) if any(n == b or n.startswith(b + ".") for b in banned))
            if bad:
                found[rel] = bad
    return found


def test_product_imports_no_eval_benchmarks_or_tests():
    assert _offenders(("sglang_ext", "patches"), ("eval", "benchmarks", "tests")) == {}


def test_eval_never_imports_training():
    assert _offenders(("eval",), ("eval.training",), skip="eval/training/") == {}


def test_kernels_package_is_not_shadowed():
    """Run from the repository root (as the tests and servers are), `import kernels` must still be
    the pip package SGLang uses, not our folder."""
    module = importlib.import_module("kernels")
    assert Path(module.__file__ or "").resolve().parent != ROOT / "kernels", module.__file__
    assert "site-packages" in Path(module.__file__ or "").parts, module.__file__


def test_tail_replay_never_names_linearkv():
    """Tail-Replay's code, its patches included, knows LinearKV only through the
    extension points LinearKV registers (`sglang_ext.hooks`), never by import or by name."""
    files = sorted((ROOT / "sglang_ext" / "tail_replay").rglob("*.py")) + sorted((ROOT / "patches" / "tail_replay").glob("*.py"))
    assert len(files) > 10, files
    named = {path.relative_to(ROOT).as_posix() for path in files if "linearkv" in path.read_text().lower()}
    assert not named


def test_linearkv_modules_import_no_cycle():
    """LinearKV's pre-pass reads the request record from the pure core, not from the adapter
    that imports it."""
    assert not any(n.startswith("sglang_ext.linearkv.sglang_cache")
                   for n in _imports(ROOT / "sglang_ext" / "linearkv" / "prepass.py"))
