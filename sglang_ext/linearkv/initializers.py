"""State initializers: the seed (recurrent state, conv window) a linear layer starts a recomputed span from.

Two readings of LinearKV's "map K chunk states to one initial state" (design note section 2.4):

- per-span (I2): every recomputed span starts from a seed that depends on the chunks before it.
  `seed(j)` is the seed for a span that follows the prefix and chunks[:j] (j = 0..K; the question
  gets j = K). Rules: `zero`, `predecessor` (LinearKV's single cached state: chunk j-1's end state
  and conv window; the prefix's exact state for j = 0), `compose` (HYPIC's exact composition of the
  prefix state and chunks[:j]; conv window of chunk j-1).
- packed (I1): all recomputed tokens form one sequence from one seed f(chunks): `packed-last`,
  `packed-first`, `packed-mean`, `packed-zero`, `packed-compose`.
- KV-only (`replay`, `replay-<r>`): no chunk state is read; every recomputed span but one starting
  right after the prefix begins up to r tokens earlier (r = 64 for `replay`), from a zero state
  and in context, and those r tokens are recomputed with it (Tail-Replay's rebuild of a linear
  state from a short tail, applied to chunks). The spans are `serving.ChunkPlan`'s (the server's).

Conv windows follow the same rule (zero, the predecessor's / last / first chunk's window, their
mean); composition does not apply to conv windows (the exact window before a token is its
predecessor chunk's own last inputs, so `compose` uses the predecessor's window).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from sglang_ext.linearkv import ops
from sglang_ext.linearkv.store import LinearLayerState


@dataclass(frozen=True)
class Seed:
    state: torch.Tensor
    conv: torch.Tensor


@dataclass(frozen=True)
class LayerChunks:
    """What one linear layer knows when seeding: its kind, the prefix's exact seed (None: empty
    prefix, i.e. zeros) and the chunks' cached states in prompt order."""

    kind: str
    chunks: Sequence[LinearLayerState]
    prefix: Seed | None = None

    def zero(self) -> Seed:
        ref = self.chunks[0] if self.chunks else None
        if ref is None:
            raise ValueError("no chunk to take state shapes from")
        return Seed(torch.zeros_like(ref.state), torch.zeros_like(ref.conv))

    def start(self) -> Seed:
        return self.prefix if self.prefix is not None else self.zero()


def _predecessor(c: LayerChunks, j: int) -> Seed:
    if j == 0:
        return c.start()
    s = c.chunks[j - 1]
    return Seed(s.state, s.conv)


def _compose(c: LayerChunks, j: int) -> Seed:
    if j == 0:
        return c.start()
    init = c.prefix.state if c.prefix is not None else None
    transitions = [s.transition for s in c.chunks[:j]]
    if any(t is None for t in transitions):
        raise ValueError("exact composition needs every chunk's transition (register chunks with transitions)")
    state = ops.compose(c.kind, [s.state for s in c.chunks[:j]], [t for t in transitions if t is not None], init)
    return Seed(state.to(c.chunks[j - 1].state.dtype), c.chunks[j - 1].conv)


def _mean(c: LayerChunks, j: int) -> Seed:
    return Seed(torch.stack([s.state for s in c.chunks]).mean(0), torch.stack([s.conv for s in c.chunks]).mean(0))


@dataclass(frozen=True)
class StateRule:
    name: str
    packed: bool                                  # I1 (one packed sequence) or I2 (per span)
    fn: Callable[[LayerChunks, int], Seed]
    needs_transitions: bool
    help: str
    #: tokens replayed from zero before each recomputed span (KV-only rules), 0 otherwise
    replay: int = 0

    def seed(self, chunks: LayerChunks, j: int) -> Seed:
        """Seed for a span after the prefix and chunks[:j] (packed rules ignore j)."""
        if not 0 <= j <= len(chunks.chunks):
            raise ValueError(f"state rule {self.name}: span index {j} outside 0..{len(chunks.chunks)}")
        return self.fn(chunks, j)


STATE_RULES: dict[str, StateRule] = {r.name: r for r in (
    StateRule("zero", False, lambda c, j: c.zero(), False, "every span starts from zero state and window"),
    StateRule("predecessor", False, _predecessor, False,
              "LinearKV single cached state: each span starts from the chunk before it (question: last chunk)"),
    StateRule("compose", False, _compose, True,
              "HYPIC exact composition of the prefix and all earlier chunks (window: predecessor's)"),
    StateRule("packed-last", True, lambda c, j: _predecessor(c, len(c.chunks)), False,
              "one packed sequence of all recomputed tokens from the last chunk's state"),
    StateRule("packed-first", True, lambda c, j: _predecessor(c, 1), False,
              "one packed sequence from the first chunk's state"),
    StateRule("packed-mean", True, _mean, False, "one packed sequence from the mean of the chunk states"),
    StateRule("packed-zero", True, lambda c, j: c.zero(), False, "one packed sequence from zero"),
    StateRule("packed-compose", True, lambda c, j: _compose(c, len(c.chunks)), True,
              "one packed sequence from the exact composition of all chunks"),
    StateRule("replay", False, lambda c, j: c.zero(), False,
              "KV-only: each recomputed span starts 64 tokens earlier from zero, in context", replay=64),
)}


def get_state_rule(name: str) -> StateRule:
    """A rule by name; `replay-<r>` is `replay` with r tokens replayed."""
    kind, _, arg = name.partition("-")
    if name not in STATE_RULES and kind == "replay" and arg.isdigit() and int(arg) > 0:
        return StateRule(name, False, lambda c, j: c.zero(), False,
                         f"KV-only: each recomputed span starts {arg} tokens earlier from zero", replay=int(arg))
    if name not in STATE_RULES:
        raise ValueError(f"unknown state initializer {name!r}; choose from {sorted(STATE_RULES)} or replay-<r>")
    return STATE_RULES[name]
