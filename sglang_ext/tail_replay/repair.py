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

**Shared-state repair** (`repair_shared: true`, the default). The first conversation to branch
from a shared prefix that holds no exact state (the end of a system prompt that the other
conversations continue differently) is served by an approximate replay, and the state it leaves
at the branch point is approximate. Stock SGLang recomputes that request (a miss) and, under its
extra buffer, keeps an exact state at the branch point (on its checkpoint grid), so every later
conversation that branches there resumes exactly on stock, and approximately here (and so do all
their later turns). So the server recomputes such a prefix exactly in the background, once (a run
over the prefix's tokens, `repair_kind: "shared_state"`), and the exact state replaces the
approximate one (`TailReplayMambaComponent.commit_insert_component_data`). Two rules ask for it:

- at the branch (`branch_repair_due`, under the extra buffer only, where stock keeps branch-point
  states): the request whose approximate plan creates the branch (its match ends where another
  request's prompt goes on, and its own prompt goes on differently) asks for the exact state at
  the checkpoint-grid depth below its match, where stock's miss would have kept it. Where every
  path going on is an earlier request's generated answer (the tree marks where each answer
  begins), the request is that conversation's next turn, not a second conversation on a shared
  prefix, and nothing is asked. The ask goes to the tokenizer
  process with the request's first output (a streamed request: right after its prefill; otherwise
  when it finishes, or at SGLang's forced stream interval), so the repair runs while the request
  decodes, and the next conversation to branch there resumes exactly, as on stock.
- below a shared approximate state (`shared_repair_due`, any state strategy): a request whose
  matched path ends its states at one that does not count as exact and below which the tree
  branches before any other state (more than one continuation has passed it) asks for that
  state's repair (without the extra buffer stock keeps no branch-point state, so there this is
  the only rule: it makes such states exact from the third visit on, which stock never does).

A conversation's own states (a leaf, or a node with one child) are never shared-state repaired:
only `repair: true` repairs those.

What it costs: one prefill of the part of the sequence that was not exact, off the answer's
critical path (sent after the answer finished; at the least-favoured priority when the server
runs `--enable-priority-scheduling`, otherwise in arrival order with the traffic). A repair run
is never repaired or audited itself, and a server keeps at most `MAX_REPAIRS_IN_FLIGHT` of them
(a repair due beyond that is skipped and logged: the conversation stays approximate until a later
turn is repaired).

Pure: no SGLang import. The scheduler side lives in `patches/tail_replay/meta.py` (the
sequence travels to the tokenizer process under `REPAIR_KEY` in `cached_tokens_details`, which the
tokenizer process removes before the client sees it), the sending in
`patches/tail_replay/repair.py`.
"""

from __future__ import annotations

from collections.abc import Sequence

from sglang_ext.tail_replay.config import TailReplayConfig
from sglang_ext.tail_replay.provenance.bounds import counts_exact

#: the `cached_tokens_details` key that carries a finished request's sequence to the tokenizer
#: process (removed there; never in a response)
REPAIR_KEY = "tail_replay_repair"
#: the `cached_tokens_details` key that carries the prefix of a shared state to repair (removed in
#: the tokenizer process; never in a response)
SHARED_REPAIR_KEY = "tail_replay_shared_repair"
#: repair runs in flight per tokenizer process
MAX_REPAIRS_IN_FLIGHT = 8
#: a shared state's repair is sent again after this long if the state is still not exact (its run
#: was skipped, or its request aborted)
SHARED_REPAIR_RESEND_S = 60.0


def repair_due(config: TailReplayConfig, *, exact: bool, finished: bool) -> bool:
    """Whether a request with this config, whose answer was `exact` or not, is repaired once it has
    `finished` (an aborted request is told apart in the tokenizer process, which sees the reason)."""
    return finished and not exact and config.knobs.repair and not config.background and not config.strict


def shared_repair_due(config: TailReplayConfig, *, bound: float, branches: int) -> bool:
    """Whether a request with this config, whose matched path's deepest state has this `bound` and
    below which the tree branches `branches` ways before any other state, asks for that state's
    shared-state repair."""
    return (config.knobs.repair_shared and not config.background and branches >= 2
            and not counts_exact(bound, config.server.exact_threshold))


def branch_repair_due(config: TailReplayConfig, *, approximate: bool, branches_here: bool,
                      keeps_branch_states: bool) -> bool:
    """Whether a request with this config, whose plan is `approximate` (it leaves no exact state
    at its branch point) and whose match ends where the tree branches off a prompt
    (`branches_here`: another request's prompt and this one's both go on, differently), asks at its own match for the
    exact state at its branch point; only where the server keeps branch-point states as stock
    SGLang's extra buffer does (`keeps_branch_states`)."""
    return (config.knobs.repair_shared and not config.background and approximate and branches_here
            and keeps_branch_states)


def repair_sequence(prompt_ids: Sequence[int], output_ids: Sequence[int]) -> list[int]:
    """The token ids a repair covers: the prompt and every output token but the last (the sequence
    SGLang caches for a finished request; with a repair run's own one output token it stays within
    the context length the request was served in)."""
    return [*prompt_ids, *output_ids[:-1]]


def repair_overrides(rid: str, kind: str = "answer") -> dict:
    """The config values of the repair run of `kind` for request `rid` (the server's mark on it,
    `request_fields.background_mark`, set out of band: no client can send them): exact reuse only; its end
    state is kept as the server keeps states (with `keep_checkpoints: false` the tree holds none,
    and a repair makes only the KV exact: the next turn still replays)."""
    return {"exactness": "exact", "repair_of": rid, "repair_kind": kind, "repair": False, "repair_shared": False}
