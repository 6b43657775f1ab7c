"""`docs/architecture.md` stays true: every module path it names exists, and every part it lists
is a class defined in the module beside it."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "architecture.md"
PATH = re.compile(r"`?((?:sglang_ext|patches|kernels|benchmarks|eval|tests|docs)/[\w/.-]+\.(?:py|md))`?")
#: a part's table row: | `attribute` | `Class` | `module path` | what it decides |
ROW = re.compile(r"^\| `\w+` \| `(\w+)` \| `([\w/.]+\.py)` \|", re.M)


def _classes(path: Path) -> set[str]:
    return {n.name for n in ast.walk(ast.parse(path.read_text())) if isinstance(n, ast.ClassDef)}


def test_every_module_the_architecture_names_exists():
    named = set(PATH.findall(DOC.read_text()))
    assert len(named) > 25, named   # the doc names the parts' modules
    missing = sorted(p for p in named if not (ROOT / p).exists())
    assert not missing, f"docs/architecture.md names modules that do not exist: {missing}"


def test_every_part_the_architecture_lists_is_a_class_of_its_module():
    rows = ROW.findall(DOC.read_text())
    assert len(rows) >= 11, rows
    wrong = [(cls, module) for cls, module in rows if cls not in _classes(ROOT / module)]
    assert not wrong, f"parts listed in docs/architecture.md that their module does not define: {wrong}"


def test_the_adapters_hold_the_parts_the_architecture_lists():
    """Each attribute in the tables is assigned (or built) in its adapter's module."""
    text = DOC.read_text()
    for adapter, module in (("TailReplayRadixCache", "sglang_ext/tail_replay/cache.py"),
                            ("TailReplayMambaComponent", "sglang_ext/tail_replay/component.py")):
        section = text.split(f"`{adapter}`", 1)[1].split("\n\n", 2)[1]
        attrs = re.findall(r"^\| `(\w+)` \|", section, re.M)
        source = (ROOT / module).read_text()
        assert attrs, adapter
        missing = [a for a in attrs if f"self.{a} =" not in source and f"def {a}(self)" not in source]
        assert not missing, f"{adapter} holds no {missing}"
