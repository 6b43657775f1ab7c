"""Tail-Replay: token-level prefix reuse for hybrid models without recurrent-state checkpoints.

This package is the wing's public face: `patches/` import only from `sglang_ext.tail_replay`,
never from its modules. Importing it loads no SGLang module (the SGLang cache adapter, `cache`,
is loaded on first use of the names that need it).

Modules: `config` (every user-facing knob, the server's config read once), `planner` (pure: how a
hit of L tokens is reused), `request` (the typed per-request record on SGLang's `Req`), `startup`
(config against server flags), `metrics` (Prometheus counters, meta_info summary), `provenance` (a
package: the bound every cached token and state carries, `provenance.bounds`; each approximate
replay's error bound from its tail's gates, `provenance.forward`; the one write path,
`provenance.writes`; the tree hooks, `provenance.tree`), `audit` (pure:
the live quality audit's sampling decision, divergence and store of served distributions),
`linear_kinds` (pure: the registry of linear-layer kinds, GDN and Mamba-2, each with its SGLang
layer classes, replay path, bound hook, state layout and naive twin),
`own_tail` (kv_mode "recompute"), `pressure` (pure: `exactness: "exact_unless_pressed"`'s
thresholds and the arrival stamp, written on the replica's first rank by
`patches/tail_replay/pressure.py` before SGLang broadcasts the request to the other ranks),
`label_transfer` (pure: PD disaggregation, the prefill server's answer label in a row of the
transferred metadata, read back by the decode server; `patches/tail_replay/disagg.py`).
The SGLang adapter (`--radix-cache-backend
tail_replay`), one concern per module: `cache` (the match and its plan, the factory), `component`
(the Mamba component), `tiers` (host and storage tiers), `state_order` (the state-only
eviction walk, and with `stock_last` which state goes first under state pressure: the
orders Tail-Replay registers in `sglang_ext.hooks`, where a policy registers its own), `branch_rules` (branch-point track, shared-state repair asks),
`kv_past_state` (KV past a finished request's last state under the extra buffer), `sessions`
(streaming sessions: a later turn planned from its session's provenance).

A request's route (SGLang 0.5.23), seam by seam:

1. config. Start-up: `sglang_ext.launcher` / `sglang_ext.plugin` validate the config
   (`server_config`) against the flags (`startup.check_start`); every scheduler checks it again
   in `cache.tail_replay_cache_factory` (the KV dtype SGLang resolved). Arrival, tokenizer
   process: `patches/tail_replay/request.py` (`SamplingParams.verify`) checks the request's
   `custom_params["tail_replay"]` with `check_request` against the server's refusals
   (`request_limits`): a bad one is that request's HTTP 400; the server's own background runs
   get their mark (`BACKGROUND_PARAM_KEY`) after that check, out of band.
2. planner. Scheduler, prefix match: `cache.TailReplayRadixCache._finalize_match_result` attaches
   the request's record (`attach`: its config resolved once, `request_overrides`), reads the
   path's provenance (`path_provenance`: in the exact mode the match is cut where the KV stops
   being strictly exact), plans the hit (`plan_replay`: exact checkpoint, exact replay,
   approximate checkpoint, approximate, miss), sets the request's carry and read floor, stores the plan and, for
   `kv_mode` "exact", the tree's KV slots of the replayed tail in the record, and sets SGLang's
   prefix length; `TailReplayMambaComponent` lets the match run as deep as the attention KV.
   Waiting requests are matched each scheduling round; `patches/tail_replay/in_batch.py` keeps
   SGLang's in-batch prefix caching working over plans (`waits_for_sibling`: a request whose hit
   is shallower than what a request ahead will leave in the tree waits a round).
   (`patches/tail_replay/sizing.py` and `patches/tail_replay/pages.py` size the state pool and
   allow pages > 1 for this backend at start-up.)
3. request record -> forward. `patches/tail_replay/batch.py` (`ForwardBatch.init_new`) reads
   each record (`record_of`): the plan goes into the counters at the first forward
   (`record_first_forward`), and the tail's rows in the packed batch with their tree slots are
   registered for the batch; `patches/tail_replay/attention.py` (`RadixAttention`) substitutes
   the cached K/V into those rows, and `patches/tail_replay/prefill_graph.py` sends such batches
   around a "full" prefill CUDA graph. The rows of approximate replays' tails are registered too:
   `patches/tail_replay/linear_bound.py`, at each registered linear kind's replay path
   (`linear_kinds`: GDN's `RadixLinearAttention.forward`, the Mamba-2 mixer's SSD scan call), adds
   each request's per-layer tail log-decay into its record (`provenance.forward`, record `tail_decay`).
4. output / metrics. `patches/tail_replay/meta.py` (`get_cached_tokens_details`) puts
   `replay_summary(record)` (the plan; for approximate hits the state bound, which also goes into
   its histogram once) into `meta_info.cached_tokens_details.tail_replay`; `/metrics` serves the
   counters of step 3 and the histogram.
5. cache. `TailReplayMambaComponent.prepare_for_caching_req` / `cleanup_after_caching_req` keep
   every state out of the tree with `keep_checkpoints: false` (record `state_withheld`);
   `commit_insert_component_data` gives new nodes and stored states the bounds
   `provenance.writes` decides (the request's own while its record holds its plan; UNTRACKED,
   never exact, without one: no record, a dropped plan, transferred KV),
   `redistribute_on_node_split` splits them, `update_component_on_insert_overlap` lets fresher KV
   of a smaller bound replace an approximate node's; with `kv_mode` "recompute" `own_tail` keeps the
   request's recomputed tail KV its own (record `own_end`, `own_kv`) until `on_release` frees it.
   HiCache (`--enable-hierarchical-cache`): the planner plans over device + host KV
   (`HostTierCache.apply_host_plan`, record `host_load`) where the host makes the prefix longer or holds the
   state a checkpoint plan starts from; `init_load_back` turns SGLang's load-back count into the
   plan's prefix and reads the tail's KV slots after the load. States go to the host only with
   checkpoints, and a host state is copied only into a plan that starts from it
   (`state_load_node`); `recover_after_unevict` keeps a host node's bounds when an insert gives it
   fresh device KV. `patches/tail_replay/host_pools.py` gives the host budget to KV
   without checkpoints. Storage (`--hicache-storage-backend`, L3): attention KV only, and only of
   strictly exact paths (`write_backup_storage`); SGLang's prefetch probe (a match without a state
   copy) sees the tree's own match, not a plan (`HostTierCache.is_storage_probe`), and prefetched pages are host
   nodes the planner plans over.
6. audit (off unless `audit_rate` > 0 or a request's `audit: true`). `patches/tail_replay/audit.py`:
   in the scheduler (`capture_pre_sample_logits`, the forward's raw logits) the first output of an
   audited request (`audit_trigger`) is kept (`PendingAudits`, record `audit`, meta_info `audit`);
   in the tokenizer process (`_handle_batch_output`) its finish sends the same prompt as an exact
   reference run (`reference_overrides`: `audit_of`), whose first output is compared with it
   (`divergence`), recorded (`record_audit`) and logged.
7. repair (off unless `repair: true`; `repair.py`). `patches/tail_replay/meta.py` adds a
   finished not-exact answer's sequence (`repair_due`, `repair_sequence`) under `REPAIR_KEY`;
   `patches/tail_replay/repair.py` removes it in the tokenizer process and sends it as an
   exact background run (`repair_overrides`: `repair_of`), whose exact KV and end state replace the
   approximate ones in the tree. Shared-state repair (on unless `repair_shared: false`): at the
   match (`SharedRepairRules.note`) a request whose approximate plan creates a
   branch under the extra buffer (`branch_repair_due`), or whose path's deepest state is
   approximate and a branch point (`shared_repair_due`), asks for an exact state there; with its
   first output the prefix goes under `SHARED_REPAIR_KEY` and is sent the same way
   (`repair_kind: "shared_state"`).
"""

from __future__ import annotations

from typing import Any

from sglang_ext.tail_replay.audit import (
    AuditResult,
    Divergence,
    PendingAudits,
    ServedAnswer,
    audit_trigger,
    divergence,
    log_probs,
    prompt_key,
    reference_overrides,
)
from sglang_ext.tail_replay.config import (
    AUTO,
    BACKEND_NAME,
    BACKGROUND_PARAM_KEY,
    DEFAULTS,
    KV_MODES,
    REQUEST_PARAM_KEY,
    BackgroundRun,
    Knobs,
    ServerConfig,
    TailReplayConfig,
    TailReplayConfigError,
    config_from_dict,
    parse_config,
    resolve,
    server_config,
    server_from_dict,
    user_settings,
    with_model_profile,
)
from sglang_ext.tail_replay.decay_profile import PERCENTILES
from sglang_ext.tail_replay.in_batch import waits_for_sibling
from sglang_ext.tail_replay.label_transfer import ROW_WORDS, decode_side_label, encode_label, merge_labels
from sglang_ext.tail_replay.linear_kinds import (
    BoundHook,
    Gates,
    GateSeam,
    LinearKind,
    NaiveTwin,
    Scope,
    StateLayout,
    TwinTail,
)
from sglang_ext.tail_replay.linear_kinds import by_name as linear_kind
from sglang_ext.tail_replay.linear_kinds import kinds_in as linear_kinds_in
from sglang_ext.tail_replay.linear_kinds import owner_of as linear_seam_owner
from sglang_ext.tail_replay.linear_kinds import register as register_linear_kind
from sglang_ext.tail_replay.linear_kinds import registered as linear_kinds
from sglang_ext.tail_replay.linear_kinds import seams_at as linear_seams_at
from sglang_ext.tail_replay.linear_kinds import targets as linear_seam_targets
from sglang_ext.tail_replay.linear_kinds import unregister as unregister_linear_kind
from sglang_ext.tail_replay.linear_kinds.gdn import gdn_log_decay
from sglang_ext.tail_replay.linear_kinds.mamba2 import mamba2_log_decay
from sglang_ext.tail_replay.metrics import (
    META_KEY,
    answer_label,
    is_recording_rank,
    output_provenance,
    plan_summary,
    record_audit,
    record_bound,
    record_first_forward,
    record_plan,
    record_repair_finished,
    records_here,
    replay_summary,
)
from sglang_ext.tail_replay.planner import HitKind, ReplayPlan, plan_replay, replay_window
from sglang_ext.tail_replay.pressure import PRESSURE_PARAM_KEY, LoadSample, PressurePolicy, pressed_by, stamp
from sglang_ext.tail_replay.provenance.bounds import CarrySegments, carry_segments
from sglang_ext.tail_replay.provenance.forward import (
    BoundSegments,
    DistributedHeadShards,
    HeadShards,
    StateBound,
    TailDecay,
    bound_segments,
    summarize,
)
from sglang_ext.tail_replay.repair import (
    MAX_REPAIRS_IN_FLIGHT,
    REPAIR_KEY,
    SHARED_REPAIR_KEY,
    branch_repair_due,
    repair_due,
    repair_overrides,
    repair_sequence,
    shared_repair_due,
)
from sglang_ext.tail_replay.request import (
    KIND_ASSEMBLED,
    KIND_TRANSFERRED_UNLABELLED,
    KIND_UNTRACKED,
    RECORD_ATTR,
    TailReplayRequest,
    attach,
    plan_of,
    record_of,
)
from sglang_ext.tail_replay.request_fields import (
    RequestLimits,
    RequestOptions,
    background_mark,
    check_request,
    request_overrides,
    with_overrides,
)
from sglang_ext.tail_replay.startup import (
    PoolFacts,
    ServerFacts,
    StartupError,
    apply_unified_memory_default,
    check_scheduler_start,
    check_start,
    facts_from_server_args,
    pool_facts_from_server_args,
    request_limits,
    unified_memory_default,
)

#: names served from `cache` (it imports SGLang's unified radix cache), loaded on first use
_FROM_CACHE = ("TailReplayRadixCache", "TailReplayMambaComponent", "tail_replay_cache_factory", "provenance_of")

__all__ = [
    "BACKEND_NAME", "DEFAULTS", "KV_MODES", "REQUEST_PARAM_KEY", "RequestLimits", "TailReplayConfig",
    "Knobs", "ServerConfig", "RequestOptions", "BackgroundRun", "resolve", "server_from_dict",
    "TailReplayConfigError", "config_from_dict", "parse_config", "request_overrides", "server_config",
    "BACKGROUND_PARAM_KEY", "background_mark", "check_request",
    "with_overrides", "user_settings", "with_model_profile", "AUTO", "PERCENTILES",
    "HitKind", "ReplayPlan", "plan_replay", "replay_window", "waits_for_sibling",
    "PRESSURE_PARAM_KEY", "LoadSample", "PressurePolicy", "pressed_by", "stamp",
    "RECORD_ATTR", "KIND_ASSEMBLED", "KIND_UNTRACKED", "TailReplayRequest", "attach", "plan_of", "record_of", "CarrySegments", "carry_segments",
    "META_KEY", "is_recording_rank", "plan_summary", "record_bound", "record_first_forward", "record_plan",
    "replay_summary", "answer_label", "output_provenance", "record_audit", "record_repair_finished", "records_here",
    "AuditResult", "Divergence", "PendingAudits", "ServedAnswer", "audit_trigger", "divergence", "log_probs",
    "prompt_key", "reference_overrides",
    "MAX_REPAIRS_IN_FLIGHT", "REPAIR_KEY", "SHARED_REPAIR_KEY", "repair_due", "repair_overrides", "repair_sequence",
    "shared_repair_due", "branch_repair_due",
    "BoundSegments", "DistributedHeadShards", "HeadShards", "StateBound", "TailDecay", "bound_segments", "gdn_log_decay", "mamba2_log_decay", "summarize",
    "BoundHook", "GateSeam", "Gates", "LinearKind", "NaiveTwin", "Scope", "StateLayout", "TwinTail", "linear_kind",
    "linear_kinds", "linear_kinds_in", "linear_seam_owner", "linear_seam_targets", "linear_seams_at",
    "register_linear_kind", "unregister_linear_kind",
    "ServerFacts", "StartupError", "check_scheduler_start", "check_start", "facts_from_server_args", "request_limits",
    "PoolFacts", "apply_unified_memory_default", "pool_facts_from_server_args", "unified_memory_default",
    "KIND_TRANSFERRED_UNLABELLED", "ROW_WORDS", "decode_side_label", "encode_label", "merge_labels",
    *_FROM_CACHE,
]


def __getattr__(name: str) -> Any:
    if name in _FROM_CACHE:
        from sglang_ext.tail_replay import cache

        return getattr(cache, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
