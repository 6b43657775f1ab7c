"""What a linear-layer kind (GDN, Mamba-2, ...) must provide: one frozen spec per kind (pure).

Tail-Replay replays a tail [L - W, L) of a linear layer from a zero state; the recurrences are
affine in the state, so the replayed state's error is the tail's transition applied to the state
dropped, at most exp(sum over the tail of the per-token log-decay) x ||S(L - W)|| per head
(`hybrid_kernels.replay_bound`). A kind says, once:

- how SGLang's forward runs its layers and where the gates are (`seams`: the replay path, each
  one SGLang call the bound patch `patches/tail_replay/linear_bound.py` wraps);
- what the bound hook computes per token from those gates (`hook`: the log-decay, and the heads
  the gate tensor must have);
- the layout of a layer's state in SGLang's state pool and in the naive twin (`state`);
- its pure-torch twin (`twin`): the recurrence the bound is a bound of, with random inputs, so
  that every kind's hook is checked against its own recurrence (tests/tail_replay/test_linear_kinds.py).

No SGLang import; torch only where tensors are computed on.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

#: a call's positional and keyword arguments, as the wrapped SGLang function received them
CallArgs = tuple[tuple[Any, ...], Mapping[str, Any]]


@dataclass(frozen=True)
class Scope:
    """What one SGLang call on the replay path knows of the running layer: the forward batch,
    SGLang's layer id, and the layer module (or mixer) itself."""

    forward_batch: Any
    layer_id: int
    layer: Any


@dataclass(frozen=True)
class Gates:
    """The gate inputs one SGLang call carries: `values` [..., heads] (the last dim the heads, the
    rows of the packed batch before it) and the layer's parameters the log-decay reads."""

    values: torch.Tensor
    params: Mapping[str, Any]


@dataclass(frozen=True)
class GateSeam:
    """One SGLang call on a kind's replay path (SGLang 0.5.23), wrapped once per process by the
    bound patch. `target`: "module:Attr.path" of the function or method replaced (a class method,
    or a module global that SGLang's callers look up at call time).

    scope(args, kwargs): the call runs one layer of a forward batch -> its Scope (None: not one
    of this kind's layers). The scope stays open while the call runs, so a nested seam reads it.
    gates(args, kwargs, layer): the call carries the gate inputs of the layer whose scope is
    open (`layer`: that scope's module) -> Gates (None: this call's layer is not of this kind).
    A seam gives either or both. `outside_prefill_graph`: the seam does nothing inside a prefill
    CUDA graph's scope (a capture-time row index would be stale there; such a request's bound is
    reported as None, `provenance.forward.summarize`)."""

    target: str
    scope: Callable[[tuple[Any, ...], Mapping[str, Any]], Scope | None] | None = None
    gates: Callable[[tuple[Any, ...], Mapping[str, Any], Any], Gates | None] | None = None
    outside_prefill_graph: bool = False

    def __post_init__(self) -> None:
        if ":" not in self.target:
            raise ValueError(f"GateSeam target {self.target!r} must read 'module:Attr.path'")
        if self.scope is None and self.gates is None:
            raise ValueError(f"GateSeam {self.target!r} gives neither a scope nor gates")


@dataclass(frozen=True)
class BoundHook:
    """What the gate hook computes per token from the layer's gates: `log_decay(rows, params)`
    -> [n, heads] fp32, each <= 0, the per-token log-decay of the rows [n, heads] of `Gates.values`
    (as the layer's kernel discretizes them); `heads(params)`: the heads a gate tensor of this
    layer has (a tensor with other heads is not this layer's and is left alone)."""

    log_decay: Callable[[torch.Tensor, Mapping[str, Any]], torch.Tensor]
    heads: Callable[[Mapping[str, Any]], int]


@dataclass(frozen=True)
class StateLayout:
    """One request's state of one layer in SGLang's state pool (`MambaPool`: `conv` and
    `temporal`, as `Mamba2StateShape` sizes them): `conv` names the conv window's axes,
    `temporal` the recurrent state's axes in the pool (heads first: the axis the bound's [heads]
    and a tensor-parallel shard index), `twin` the same axes in the naive twin's convention."""

    conv: tuple[str, ...]
    temporal: tuple[str, ...]
    twin: tuple[str, ...]

    def __post_init__(self) -> None:
        if sorted(self.temporal) != sorted(self.twin) or len(set(self.temporal)) != len(self.temporal):
            raise ValueError(f"StateLayout: twin axes {self.twin} must be the pool's axes {self.temporal} reordered")
        if self.temporal[0] != "heads" or self.twin[0] != "heads":
            raise ValueError(f"StateLayout: the recurrent state's first axis must be 'heads', got {self.temporal}")

    def to_twin(self, temporal: torch.Tensor) -> torch.Tensor:
        """Pool layout [..., *temporal] -> the twin's [..., *twin] (a view; mutates nothing)."""
        return _permuted(temporal, self.temporal, self.twin)

    def to_pool(self, state: torch.Tensor) -> torch.Tensor:
        """The twin's [..., *twin] -> pool layout [..., *temporal] (a view; mutates nothing)."""
        return _permuted(state, self.twin, self.temporal)


def _permuted(x: torch.Tensor, have: tuple[str, ...], want: tuple[str, ...]) -> torch.Tensor:
    lead = x.dim() - len(have)
    return x.permute(*range(lead), *(lead + have.index(axis) for axis in want))


@dataclass(frozen=True)
class TwinTail:
    """Random inputs of one replayed tail for the naive twin: `inputs` (the recurrence's own,
    by name), `gates` (what the bound hook reads of the same tail: values [T, heads] and params)
    and the twin's `state_shape` ([heads, ...], twin layout)."""

    inputs: Mapping[str, torch.Tensor]
    gates: Gates
    state_shape: tuple[int, ...]


@dataclass(frozen=True)
class NaiveTwin:
    """The kind's recurrence in pure torch (`hybrid_kernels`): `replay(inputs, state)` -> the end
    state (fp32, twin layout) from `state` over the tail `inputs`; `random_tail(generator, tokens,
    heads)`: a TwinTail to run it on. Neither mutates its arguments."""

    replay: Callable[[Mapping[str, torch.Tensor], torch.Tensor], torch.Tensor]
    random_tail: Callable[[torch.Generator, int, int], TwinTail]


@dataclass(frozen=True)
class LinearKind:
    """One linear-layer kind. `name`: its registry key ("gdn", "mamba2"); `layer_classes`: the
    SGLang classes ("module:Class") its layers are instances of; `seams` (the replay path),
    `hook`, `state`, `twin`: see the module docstring. `scalar_decay`: a tail's transition is
    the scalar exp(sum of its log-decay) per head (Mamba-2), so the hook's factor is the error's
    size exactly and chunks compose from their decays alone (h <- a h + s per chunk);
    False: a matrix per head (GDN), the factor only bounds it."""

    name: str
    layer_classes: tuple[str, ...]
    seams: tuple[GateSeam, ...]
    hook: BoundHook
    state: StateLayout
    twin: NaiveTwin
    scalar_decay: bool = False

    def __post_init__(self) -> None:
        if not self.name or not self.name.isidentifier():
            raise ValueError(f"LinearKind name {self.name!r} must be an identifier")
        if not self.seams:
            raise ValueError(f"LinearKind {self.name!r} has no seam: its replay's gates would never be read")
        if not any(seam.scope is not None for seam in self.seams) or not any(seam.gates is not None for seam in self.seams):
            raise ValueError(f"LinearKind {self.name!r} needs a seam that opens a scope and one that reads gates")
        if any(":" not in path for path in self.layer_classes) or not self.layer_classes:
            raise ValueError(f"LinearKind {self.name!r}: layer_classes must name 'module:Class' entries")


def call_arg(args: tuple[Any, ...], kwargs: Mapping[str, Any], index: int, name: str, default: Any = None) -> Any:
    """The argument at position `index` (counting `self` of a method), or keyword `name`."""
    return args[index] if len(args) > index else kwargs.get(name, default)
