"""The registry of linear-layer kinds: each kind's spec (`spec.LinearKind`: its SGLang layer
classes, replay path, bound hook, state layout and naive twin) in one place.

Built in: `gdn` (Gated DeltaNet) and `mamba2` (Mamba-2), one module each, loaded on the first read
of the registry (`BUILTIN`). A new kind is one module beside them that defines `KIND` plus its
name in `BUILTIN`; or, outside this package, one `register(kind)` call before the bound patch is
applied (`patches/tail_replay/linear_bound.py` installs every registered kind's seams and reads
the registry again on every call, so a kind registered on an already wrapped target is served too).

Readers: the bound patch (`seams_at`, `targets`), other wings through the face (`kinds_in`: which
kinds a served model's layers are), the tests (`registered`, `by_name`).

May mutate: the module's registry and its cache of seams per target (`register`, `unregister`).
No SGLang import at import time.
"""

from __future__ import annotations

import importlib
from typing import Any

from sglang_ext.tail_replay.linear_kinds.spec import (
    BoundHook,
    Gates,
    GateSeam,
    LinearKind,
    NaiveTwin,
    Scope,
    StateLayout,
    TwinTail,
    call_arg,
)

#: the kinds this package defines, each a module of it whose `KIND` is registered on first read
BUILTIN: tuple[str, ...] = ("gdn", "mamba2")

_kinds: dict[str, LinearKind] = {}
_builtin_loaded = False
#: target -> its (kind, seam) pairs, read by the bound patch on every call; emptied on every change
_seams_by_target: dict[str, tuple[tuple[LinearKind, GateSeam], ...]] = {}

__all__ = ["BUILTIN", "BoundHook", "GateSeam", "Gates", "LinearKind", "NaiveTwin", "Scope", "StateLayout",
           "TwinTail", "by_name", "call_arg", "kinds_in", "owner_of", "register", "registered", "resolve", "seams_at",
           "targets", "unregister"]


def _load_builtin() -> None:
    global _builtin_loaded
    if not _builtin_loaded:
        _builtin_loaded = True
        for name in BUILTIN:
            kind = importlib.import_module(f"{__name__}.{name}").KIND
            if kind.name != name:
                raise ValueError(f"linear kind module {name!r} defines a kind named {kind.name!r}")
            _kinds.setdefault(name, kind)


def register(kind: LinearKind, *, replace: bool = False) -> LinearKind:
    """Add `kind` to the registry (after the built-in kinds). A second kind of the same name is a
    ValueError unless `replace`. Returns it. May mutate: the registry."""
    _load_builtin()
    if kind.name in _kinds and _kinds[kind.name] is not kind and not replace:
        raise ValueError(f"linear kind {kind.name!r} is already registered")
    _kinds[kind.name] = kind
    _seams_by_target.clear()
    return kind


def unregister(name: str) -> LinearKind | None:
    """Remove the kind `name` (its seams, once installed, then find no kind at their target and
    pass every call through). Returns it, or None. May mutate: the registry."""
    _load_builtin()
    _seams_by_target.clear()
    return _kinds.pop(name, None)


def registered() -> tuple[LinearKind, ...]:
    """Every registered kind, in registration order (built-in first)."""
    _load_builtin()
    return tuple(_kinds.values())


def by_name(name: str) -> LinearKind:
    _load_builtin()
    if name not in _kinds:
        raise KeyError(f"no linear kind {name!r}; registered: {sorted(_kinds)}")
    return _kinds[name]


def targets() -> tuple[str, ...]:
    """Every SGLang target some registered kind's replay path goes through, each once, in order."""
    return tuple(dict.fromkeys(seam.target for kind in registered() for seam in kind.seams))


def seams_at(target: str) -> tuple[tuple[LinearKind, GateSeam], ...]:
    """(kind, seam) of every registered kind with a seam at `target`, in registration order
    (cached until the registry changes: the bound patch asks on every call)."""
    found = _seams_by_target.get(target)
    if found is None:
        found = tuple((kind, seam) for kind in registered() for seam in kind.seams if seam.target == target)
        _seams_by_target[target] = found
    return found


def owner_of(path: str) -> tuple[Any, str]:
    """("module:Attr.path") -> (the object holding its last attribute, that attribute's name);
    imports the module."""
    module, _, attrs = path.partition(":")
    *walk, name = attrs.split(".")
    obj: Any = importlib.import_module(module)
    for attr in walk:
        obj = getattr(obj, attr)
    return obj, name


def resolve(path: str) -> Any:
    """The object at "module:Attr.path" (imports the module)."""
    return getattr(*owner_of(path))


def kinds_in(model: Any) -> tuple[LinearKind, ...]:
    """The registered kinds some module of `model` (a torch module) is a layer of, by
    `layer_classes` (imports those classes: call it where SGLang is loaded)."""
    kinds = registered()
    classes = {kind.name: tuple(resolve(path) for path in kind.layer_classes) for kind in kinds}
    modules = list(model.modules())
    return tuple(kind for kind in kinds if any(isinstance(m, classes[kind.name]) for m in modules))
