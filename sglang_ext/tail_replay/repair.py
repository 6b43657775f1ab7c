"""Exact repair: an approximate answer is paid for once, then the tree is made exact again.

Off by default (`repair: true` in the server's config, or per request). When a request whose answer
was not exact (meta_info `exact` false: it started from an approximate replay or an approximate
checkpoint, and its bound did not decay below `exact_threshold`) finishes normally, the server sends
its sequence again as a background run: the prompt and the output (all but the last output token,
whose KV no request computed: that is also what SGLang inserts when a request finishes), one
greedy token, `exactness: "exact"` (only bound-0 nodes and states are reused; everything else is
recomputed), its end state kept as the server keeps states. What it inserts is exact, and exact KV
replaces the approximate nodes on the same tokens where no request holds them
(`TailReplayMambaComponent.update_component_on_insert_overlap`). So the conversation's next turn,
which extends this sequence, finds exact KV and an exact state near its match and resumes
exactly. (A second run over the prompt alone, so that a client resending the prompt with its own
continuation resumes exactly too, was measured and dropped: its extra state per repair cost more
reuse under state pressure than it saved, docs/trace_replay.md section (d).) The approximation
stays with the one answer that bought the lower time-to-first-token and does not spread into the
conversation's later turns, nor into other clients' hits on the same tokens.

What it costs: one prefill of the part of the sequence that was not exact, off the answer's
critical path (sent after the answer finished; at the least-favoured priority when the server
runs `--enable-priority-scheduling`, otherwise in arrival order with the traffic). A repair run
is never repaired or audited itself, and a server keeps at most `MAX_REPAIRS_IN_FLIGHT` of them
(a repair due beyond that is skipped and logged: the conversation stays approximate until a later
turn is repaired).

Pure: no SGLang import. The scheduler side lives in `sglang_ext/patches/tail_replay_meta.py` (the
sequence travels to the tokenizer process under `REPAIR_KEY` in `cached_tokens_details`, which the
tokenizer process removes before the client sees it), the sending in
`sglang_ext/patches/tail_replay_audit.py`.
"""

from __future__ import annotations

from collections.abc import Sequence

from sglang_ext.tail_replay.config import TailReplayConfig

#: the `cached_tokens_details` key that carries a finished request's sequence to the tokenizer
#: process (removed there; never in a response)
REPAIR_KEY = "tail_replay_repair"
#: repair runs in flight per tokenizer process
MAX_REPAIRS_IN_FLIGHT = 8


def repair_due(config: TailReplayConfig, *, exact: bool, finished: bool) -> bool:
    """Whether a request with this config, whose answer was `exact` or not, is repaired once it has
    `finished` (an aborted request is told apart in the tokenizer process, which sees the reason)."""
    return finished and not exact and config.repair and not config.background and not config.strict


def repair_sequence(prompt_ids: Sequence[int], output_ids: Sequence[int]) -> list[int]:
    """The token ids a repair covers: the prompt and every output token but the last (the sequence
    SGLang caches for a finished request; with a repair run's own one output token it stays within
    the context length the request was served in)."""
    return [*prompt_ids, *output_ids[:-1]]


def repair_overrides(rid: str) -> dict:
    """`custom_params["tail_replay"]` of the repair run for request `rid`: exact reuse only; its end
    state is kept as the server keeps states (with `keep_checkpoints: false` the tree holds none,
    and a repair makes only the KV exact: the next turn still replays)."""
    return {"exactness": "exact", "repair_of": rid, "repair": False}
