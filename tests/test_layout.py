"""The package layout's one-way dependencies: product <- eval <- training.

- `sglang_ext/` and `patches/` (what a user installs to serve) import nothing from `eval`,
  `benchmarks` or `tests`;
- `eval/` outside `eval/training/` never imports `eval.training` (training -> eval, not back);
- our top-level `kernels/` folder never shadows the `kernels` package SGLang depends on.
"""

from __future__ import annotations

import ast
import functools
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


def _project_classes() -> dict[str, set[str]]:
    """{class name: the modules (dotted, `patches/` as `sglang_ext.patches`) defining a class of
    that name} over `sglang_ext/` and `patches/`."""
    found: dict[str, set[str]] = {}
    for path, module in _product_modules():
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.ClassDef):
                found.setdefault(node.name, set()).add(module)
    return found


def _product_modules() -> list[tuple[Path, str]]:
    out = []
    for folder, package in (("sglang_ext", "sglang_ext"), ("patches", "sglang_ext.patches")):
        for path in sorted((ROOT / folder).rglob("*.py")):
            parts = path.relative_to(ROOT / folder).with_suffix("").parts
            parts = parts[:-1] if parts[-1] == "__init__" else parts
            out.append((path, ".".join((package, *parts))))
    return out


def _project_bases(tree: ast.Module, module: str, classes: dict[str, set[str]]) -> dict[str, list[str]]:
    """{class defined in `tree`: its bases that resolve to a class defined in the project}. A base
    resolves through the module's own classes and its imports (`from X import Name`, `import X as
    Y` then `Y.Name`); a name imported from a project module counts when a project class has that
    name (re-exports through a package's public face included)."""
    imported: dict[str, str] = {}   # local name -> the project module it comes from
    package = module if module.endswith("__init__") else module.rsplit(".", 1)[0]
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            source = node.module or ""
            if node.level:
                source = ".".join(package.split(".")[:len(package.split(".")) - node.level + 1] + ([source] if source else []))
            for alias in node.names:
                imported[alias.asname or alias.name] = source
        elif isinstance(node, ast.Import):
            for alias in node.names:
                imported[alias.asname or alias.name.split(".")[0]] = alias.name if alias.asname else alias.name.split(".")[0]
    own = {n.name for n in tree.body if isinstance(n, ast.ClassDef)}
    out: dict[str, list[str]] = {}
    for node in ast.walk(tree):
        if not isinstance(node, ast.ClassDef):
            continue
        ours = []
        for base in node.bases:
            if isinstance(base, ast.Name):
                name, source = base.id, imported.get(base.id)
                if name in own and source is None:
                    ours.append(name)
                    continue
            elif isinstance(base, ast.Attribute) and isinstance(base.value, ast.Name):
                name, source = base.attr, imported.get(base.value.id)
            else:
                continue
            if source is not None and source.startswith("sglang_ext") and name in classes:
                ours.append(name)
        out[node.name] = ours
    return out


def test_no_class_takes_two_or_more_project_bases():
    """No class in `sglang_ext/` or `patches/` takes two or more bases defined in the project:
    the SGLang adapters compose named parts instead of mixing in slices of each other."""
    classes = _project_classes()
    offenders = {}
    for path, module in _product_modules():
        for name, bases in _project_bases(ast.parse(path.read_text(), filename=str(path)), module, classes).items():
            if len(bases) >= 2:
                offenders[f"{path.relative_to(ROOT).as_posix()}:{name}"] = bases
    assert offenders == {}


WINGS = ("tail_replay", "eviction", "linearkv")


@functools.cache
def _privates_defined(folder: Path) -> frozenset[str]:
    """Names with one leading underscore a wing (a folder, or one module) defines (functions,
    classes, module globals and attributes it assigns on `self` or elsewhere)."""
    names: set[str] = set()
    for path in ([folder] if folder.suffix == ".py" else folder.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                names.add(node.name)
            elif isinstance(node, ast.Assign):
                for target in node.targets:
                    if isinstance(target, ast.Name):
                        names.add(target.id)
                    elif isinstance(target, ast.Attribute):
                        names.add(target.attr)
    return frozenset(n for n in names if n.startswith("_") and not n.startswith("__"))


def _privates_of_sglang() -> set[str]:
    """Underscore names that occur in SGLang's own code (the hooks a wing overrides, e.g.
    `_evict_device_start`, are SGLang's, not the wing's)."""
    import re

    import sglang

    word = re.compile(r"(?<![\w.])_[A-Za-z]\w*|(?<=\.)_[A-Za-z]\w*")
    return {name for path in (Path(sglang.__file__).parent / "srt").rglob("*.py")
            for name in word.findall(path.read_text(errors="replace"))}


def test_no_module_outside_a_wing_names_that_wings_privates():
    """Outside a wing (the patches, the other wings, the top-level modules) no code reads or
    imports a name the wing keeps private (one leading underscore), unless it is SGLang's own
    (a hook the wing overrides)."""
    sglang_names = _privates_of_sglang()
    offenders = []
    for wing in WINGS:
        folder = ROOT / "sglang_ext" / wing
        private = _privates_defined(folder) - sglang_names
        assert private, wing
        for path, _ in _product_modules():
            if folder in path.parents:
                continue
            home = next((ROOT / "sglang_ext" / w for w in WINGS if ROOT / "sglang_ext" / w in path.parents), path)
            theirs = private - _privates_defined(home)   # a name the module's own wing defines is its own
            for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
                named = None
                if isinstance(node, ast.Attribute) and node.attr in theirs:
                    named = node.attr
                elif isinstance(node, ast.ImportFrom) and node.module and node.module.startswith(f"sglang_ext.{wing}"):
                    named = next((a.name for a in node.names if a.name in theirs), None)
                if named is not None:
                    offenders.append(f"{path.relative_to(ROOT).as_posix()}:{node.lineno}: {wing}'s {named}")
    assert offenders == []


def test_the_modules_scheduled_first_exist():
    """tests/conftest.py's LONGEST_FIRST names test modules that exist (a renamed one would
    silently lose its place)."""
    from tests.conftest import LONGEST_FIRST

    assert [path for path in LONGEST_FIRST if not (ROOT / path).is_file()] == []
