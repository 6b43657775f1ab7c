"""The pressure policy of `exactness: "exact_unless_pressed"` (pure: no SGLang import).

The operator sets thresholds on the load SGLang reports (config key `pressure`, server only):

    {"exactness": "exact_unless_pressed",
     "pressure": {"queue_wait_s": 0.5, "num_queue_reqs": 8, "num_queue_tokens": 32768,
                  "token_usage": 0.9, "mamba_usage": 0.9, "tolerance": 0.01}}

- `queue_wait_s`: how long the oldest request in SGLang's waiting queue has waited, in seconds
  (SGLang's own queue-entry stamp, `time_stats.wait_queue_entry_time`; 0 with an empty queue). The
  TTFT SLO's threshold: once requests wait that long, serving every arrival exactly is breaking the
  SLO, so arrivals take approximate plans within the tolerance until the queue drains. Set it to
  what the SLO leaves for queueing (the SLO minus a prefill's own time);
- `num_queue_reqs`: requests waiting in the scheduler's queue (SGLang's `#queue-req`,
  `sglang:num_queue_reqs`), the request's own predecessors in the same poll included;
- `num_queue_tokens`: prompt tokens of those waiting requests;
- `token_usage`: the KV pool's use by running requests, as SGLang reports it (`sglang:token_usage`:
  cached tokens that could be evicted do not count), in [0, 1];
- `mamba_usage`: the recurrent-state pool's use, likewise (`sglang:mamba_usage`), in [0, 1];
- `tolerance`: the certified state bound (the planner's, before the forward: a fresh replay's
  d^W from the model's decay profile, an approximate checkpoint's stored bound) up to which a
  pressed request may take an approximate plan, in (0, 1] (default 0.01).

A threshold left out is not watched; a request is pressed when any watched value is at or above
its threshold (so 0 means always pressed). `pressed_by` names the thresholds met, in this order.

The decision is taken once per request, when the scheduler of the replica's first rank receives it
from the tokenizer, and written into the request out of band (`PRESSURE_PARAM_KEY` in its
`custom_params`) before SGLang broadcasts the received requests to the other ranks
(`patches/tail_replay/pressure.py`): every rank plans from the same stamp, never from its own
clock or queue. A client sending that key gets a 400 (`request_fields.check_request`). The decision is as
old as the request's arrival: a request that waits in the queue keeps it.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

#: `custom_params` key of the server's pressure stamp (set on the replica's first rank, refused
#: from a client)
PRESSURE_PARAM_KEY = "tail_replay_pressure"
#: the thresholds, in the order `pressed_by` names them
THRESHOLDS = ("queue_wait_s", "num_queue_reqs", "num_queue_tokens", "token_usage", "mamba_usage")
_COUNTS = ("num_queue_reqs", "num_queue_tokens")
_KEYS = (*THRESHOLDS, "tolerance")


@dataclass(frozen=True)
class PressurePolicy:
    """The operator's thresholds (None: not watched) and tolerance."""

    num_queue_reqs: int | None = None
    num_queue_tokens: int | None = None
    token_usage: float | None = None
    mamba_usage: float | None = None
    tolerance: float = 0.01
    queue_wait_s: float | None = None

    def as_dict(self) -> dict:
        """The policy as the operator writes it (thresholds not watched left out)."""
        return {key: getattr(self, key) for key in _KEYS if getattr(self, key) is not None}


@dataclass(frozen=True)
class LoadSample:
    """The load a request arrives into (SGLang's own figures, see the module docstring)."""

    num_queue_reqs: int
    num_queue_tokens: int
    token_usage: float
    mamba_usage: float | None = None   # None: no state pool
    queue_wait_s: float | None = None  # None: not read (a sample without it never meets that threshold)


def parse_policy(raw: object, error: Callable[[str], Exception] = ValueError) -> PressurePolicy:
    """The policy from the config's `pressure` object; `error(message)` is raised naming the key
    (`pressure.<key>`) of a bad one."""
    def fail(key: str, message: str) -> Exception:
        return error(f"tail-replay config key 'pressure.{key}': {message}" if key else
                     f"tail-replay config key 'pressure': {message}")

    if not isinstance(raw, dict):
        raise fail("", f"must be a JSON object, got {raw!r:.60}")
    for key, value in raw.items():
        if key not in _KEYS:
            raise fail(key, f"unknown key; known keys: {list(_KEYS)}")
        if isinstance(value, bool) or not isinstance(value, int if key in _COUNTS else (int, float)):
            raise fail(key, f"has the wrong type ({value!r})")
        if key in _COUNTS and value < 0:
            raise fail(key, f"must be >= 0, got {value}")
        if key in ("token_usage", "mamba_usage") and not 0.0 <= value <= 1.0:
            raise fail(key, f"must be in [0, 1], got {value}")
        if key == "queue_wait_s" and not (0.0 <= value and math.isfinite(value)):
            raise fail(key, f"must be a finite number of seconds >= 0, got {value}")
        if key == "tolerance" and not (0.0 < value <= 1.0 and math.isfinite(value)):
            raise fail(key, f"must be in (0, 1], got {value}")
    if not any(key in raw for key in THRESHOLDS):
        raise fail("", f"sets no threshold: set at least one of {list(THRESHOLDS)}")
    values: dict = {key: (float(v) if key not in _COUNTS else v) for key, v in raw.items()}
    return PressurePolicy(**values)


def pressed_by(policy: PressurePolicy, load: LoadSample) -> tuple[str, ...]:
    """The thresholds `load` meets (value >= threshold), in `THRESHOLDS` order; () when none."""
    met = []
    for key in THRESHOLDS:
        threshold, value = getattr(policy, key), getattr(load, key)
        if threshold is not None and value is not None and value >= threshold:
            met.append(key)
    return tuple(met)


def stamp(policy: PressurePolicy, load: LoadSample) -> dict:
    """The stamp written into a request at its arrival: the thresholds met and the load seen."""
    return {"pressed_by": list(pressed_by(policy, load)),
            "load": {key: getattr(load, key) for key in THRESHOLDS if getattr(load, key) is not None}}


def read_stamp(custom_params: object) -> tuple[str, ...]:
    """The thresholds a request's stamp says were met at its arrival; () without a stamp or with
    one that is not the server's shape (fail closed: not pressed, the request stays exact)."""
    mark = custom_params.get(PRESSURE_PARAM_KEY) if isinstance(custom_params, dict) else None
    names = mark.get("pressed_by") if isinstance(mark, dict) else None
    if not isinstance(names, list) or not all(name in THRESHOLDS for name in names):
        return ()
    return tuple(names)
