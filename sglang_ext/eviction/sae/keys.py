"""The names SAE files its learning and its queues under.

* ``State``: what an owner's last request ended with: a token type, or for outputs an
  ``OutputState`` (the type and the log2 size class of the output it cached);
* ``ReuseClass`` (queue, state): the class whose reuse-time model is learned ("klass"
  everywhere in this package);
* ``RankClass`` (reuse class, cost bucket, pace): the queue an owner is ranked in; all
  owners of one rank class share one value curve, so only the oldest and the youngest
  head of each need scoring.

NamedTuples hash and compare like the plain tuples they replace, so learned state keyed
by them stays addressable as ``("session", ("tool_call", 1))``.
"""

from __future__ import annotations

from typing import NamedTuple

QUEUES = ("shared", "session", "single")
OUTPUT_TYPES = frozenset(("response", "reasoning", "tool_call"))
MAX_SIZE_CLASS = 7  # output size classes: log2 buckets of cached output blocks, capped
PACE_STEP = 0.7  # log-time width of the per-session pace buckets


class OutputState(NamedTuple):
    """An output state split by the size of the output cached (generating long takes long)."""

    token_type: str
    size_class: int


State = str | OutputState


class ReuseClass(NamedTuple):
    """The class of an owner for learning: its queue and its state."""

    queue: str
    state: State


class RankClass(NamedTuple):
    """The queue an owner is ranked in: its reuse class, the log2 recompute-cost bucket
    of its head entry and its session pace bucket."""

    klass: ReuseClass
    cost_bucket: int
    pace: int


def output_state(token_type: str, out_blocks: int) -> OutputState:
    """The size-split state of an output of ``out_blocks`` cached blocks."""
    return OutputState(token_type, min(out_blocks.bit_length(), MAX_SIZE_CLASS))
