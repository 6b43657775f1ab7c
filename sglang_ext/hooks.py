"""Extension points between the wings: what one wing adds to another's seams, registered by the
wing that adds it, so no wing imports another's internals (and Tail-Replay's code never names
LinearKV). The plugin wires them once per process (`sglang_ext.plugin.register_cache_backends`,
which every SGLang process of a patched server runs). Pure: no SGLang import.

- decay captures: `req -> (accumulator, first, end) | None`: prefill rows of a request whose
  per-layer log-decays the gate hooks sum (Tail-Replay's bound seam, `patches/tail_replay/batch.py`),
  beside Tail-Replay's own approximate tails. LinearKV: a chunk registration's transition.
- meta contributors: `req -> (key, summary) | None`: a per-request summary added to
  `meta_info.cached_tokens_details[key]` (`patches/tail_replay/meta.py`).
- request backends: radix-cache backends whose requests carry Tail-Replay request fields (validated
  on arrival by `patches/tail_replay/request.py`). LinearKV serves its exact prefix with Tail-Replay.

May mutate: the module's registries (registration only; idempotent per function or name).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

DecayCapture = Callable[[Any], "tuple[Any, int, int] | None"]
MetaContributor = Callable[[Any], "tuple[str, Any] | None"]

_decay_captures: list[DecayCapture] = []
_meta_contributors: list[MetaContributor] = []
_request_backends: set[str] = set()


def add_decay_capture(fn: DecayCapture) -> None:
    if fn not in _decay_captures:
        _decay_captures.append(fn)


def add_meta_contributor(fn: MetaContributor) -> None:
    if fn not in _meta_contributors:
        _meta_contributors.append(fn)


def add_request_backend(name: str) -> None:
    _request_backends.add(name)


def decay_capture(req: Any) -> tuple[Any, int, int] | None:
    """The first registered capture of a request, or None."""
    for fn in _decay_captures:
        found = fn(req)
        if found is not None:
            return found
    return None


def meta_contributions(req: Any) -> list[tuple[str, Any]]:
    """Every registered summary of a request, as (key, summary)."""
    return [found for fn in _meta_contributors if (found := fn(req)) is not None]


def request_backends() -> frozenset[str]:
    return frozenset(_request_backends)
