"""Version-guarded runtime patches to SGLang 0.5.23, applied before SGLang is imported.

Each module in this package patches one SGLang seam and names the file it targets
(`TARGET`). Folders by wing: `cpu/` (the CPU patch set; `cpu/ops/` its torch ops), `tail_replay/`,
`sae/`, `linearkv/`, and `shared/` (seams every backend goes through, and fixes to SGLang itself);
`version.py` is the guard all of them share. `apply_patches(mode)` checks the installed SGLang version first, then applies:

- mode "cpu": the CPU patch set (stand-in `sgl_kernel` CPU ops, driverless-CUDA-torch fixes,
  torch fallbacks for Triton-only paths, O(new x context) extend attention, stock HiCache's host
  tier: unpinned host pools and torch `direct` copies, `cpu/hicache`; `--enable-deterministic-inference`
  with batch-invariant matrix products, `cpu/deterministic`), then the extension's own
  seams;
- mode "gpu": only the extension's own seams and the request check (`shared/request_token_ids`);
  SGLang's fast paths stay untouched.

The extension's own seams (`EXT_PATCHES`) are Tail-Replay's, one SGLang function each; they reach
the wing only through its public face, `sglang_ext.tail_replay` (whose docstring walks a
request through them): `tail_replay/request` (request check on arrival), `tail_replay/sizing` and
`tail_replay/pages` (start-up: state-pool size, pages > 1), `tail_replay/host_pools` (start-up,
HiCache: the whole host budget to KV, the host tier holds no states), `tail_replay/batch` (tail rows per
forward batch, metrics), `tail_replay/attention` and `tail_replay/prefill_graph` (exact cached K/V
for the tail), `tail_replay/forward_scope` (whether the running forward has rows to bound),
`tail_replay/linear_bound` (each approximate replay's state bound from its tail's
gates, at every registered linear-layer kind's seams: `sglang_ext.tail_replay.linear_kinds`), `tail_replay/meta` (the per-request summaries in meta_info,
Tail-Replay's and LinearKV's), `shared/ipc_json` (request fields and
those summaries across SGLang's IPC in both modes; after the audit's patch, so its decoding runs
first), `tail_replay/audit` (the live quality audit: the first output's
logits of audited requests, their exact reference runs sent by the tokenizer process),
`tail_replay/repair` (exact and shared-state repair runs, sent by the tokenizer process),
`tail_replay/session` (a finished streaming-session turn's own recomputed tail is freed when its
row goes to the session), `tail_replay/disagg` (PD disaggregation: the prefill server's answer
label carried to the decode server in one more metadata buffer), `tail_replay/pressure` (`exact_unless_pressed`: the first rank stamps each
request with the pressure decision before SGLang broadcasts it to the other ranks),
`tail_replay/in_batch` (SGLang's in-batch prefix caching over Tail-Replay's plans: a waiting
request whose hit is shallower than what a request ahead will leave in the tree waits a round),
`linearkv/request` (LinearKV: chunks found and registered on arrival), `linearkv/prepass`
(LinearKV: EPIC's chunk heads recomputed in the worker before the question's forward),
`linearkv/admission` (LinearKV: every admission round's state slots budgeted, loads included),
`shared/session_tenancy` (a session belongs to its first turn's cache namespace; a turn from another
is refused, on every backend).
Four fixes to SGLang itself ride with them, because they hit GPUs too: `shared/mamba_conv_dtype` (the
linear layers' conv-window state in the model's dtype, not a fixed bfloat16, which the `extra_buffer`
strategy's tracking copy requires), `shared/seeded_sampling` (under `--enable-deterministic-inference`, a
seeded request samples the same token whether or not another request of its batch filters with
top-k, top-p or greedy) and `shared/session_storage_prefetch` (a streaming session's turn on a server with
HiCache's storage tier: the storage prefetch asked the tree about the session slot's stand-in node,
and the scheduler died) and `shared/unified_mamba_admission` (under `--enable-unified-memory` with the
extra buffer, admission reserves a new request's tracking slots too: their bytes come out of the KV
budget, and the extend's KV allocation failed under memory pressure).

Applying a module twice is a no-op. Spawned SGLang children re-apply from `sglang_ext.env`'s
`SGLANG_EXT_PATCH_MODE`: under the launcher through `sglang_ext.spawn_main` (imported by every
spawned child before it imports SGLang), under a plain SGLang launch through the plugin
(`sglang_ext.plugin.register`).
"""

from __future__ import annotations

import importlib
import logging

from sglang_ext.patches.version import check_sglang_version

logger = logging.getLogger(__name__)

#: Applied in this order in "cpu" mode. Module names inside this package.
CPU_PATCHES: tuple[str, ...] = (
    "cpu.sgl_kernel_stub",      # must come first: SGLang imports sgl_kernel at import time
    "cpu.device_module",
    "cpu.norm",
    "cpu.elementwise",
    "cpu.gdn",
    "cpu.extend_attention",
    "cpu.mamba2",
    "cpu.moe",
    "cpu.nemotron_h_router",
    "cpu.memory_budget",
    "cpu.pin_memory",
    "cpu.hicache",          # HiCache host tier: unpinned host pools, torch `direct` copies, RAM reserve
    "cpu.start_method",     # SGLANG_EXT_CPU_START_METHOD=fork: children forked, not spawned
    "cpu.mamba_track",
    "cpu.extra_buffer",     # after cpu_gdn / cpu_mamba2: the ops extra_buffer reads
    "cpu.deterministic",    # --enable-deterministic-inference: torch_native admitted, row-by-row mm
    "cpu.unified_memory",   # --enable-unified-memory: torch_native reads and writes through the id translation
)
#: Applied in both modes (the extension's own seams).
EXT_PATCHES: tuple[str, ...] = (
    "tail_replay.batch", "tail_replay.attention", "tail_replay.prefill_graph", "tail_replay.forward_scope",
    "tail_replay.linear_bound",
    "tail_replay.meta", "tail_replay.audit", "tail_replay.repair", "shared.ipc_json", "tail_replay.request",
    "tail_replay.pressure", "tail_replay.in_batch", "tail_replay.session", "shared.session_tenancy", "tail_replay.sizing",
    "tail_replay.pages", "tail_replay.host_pools", "shared.request_token_ids", "linearkv.request",
    "linearkv.prepass", "linearkv.admission", "sae.policy", "sae.tree_core", "sae.cache_events",
    "sae.full_eviction", "sae.state_eviction", "sae.request", "sae.chat", "shared.mamba_conv_dtype",
    "shared.seeded_sampling", "shared.session_storage_prefetch", "shared.unified_mamba_admission",
    "tail_replay.disagg",
)

_applied: list[str] = []


def apply_patches(mode: str) -> list[str]:
    """Apply the patch set for `mode` (each module once per process); return the modules applied."""
    if mode not in ("cpu", "gpu"):
        raise ValueError(f"patch mode must be 'cpu' or 'gpu', got {mode!r}")
    check_sglang_version()   # every call: a launcher must refuse a wrong SGLang even if patched
    return _apply((CPU_PATCHES if mode == "cpu" else ()) + EXT_PATCHES)


def apply_cpu_patches() -> list[str]:
    """Only the CPU patch set (no extension seams): for a process whose extension seams come
    from the SGLang plugin entry point alone (see tests/e2e/test_request_hardening.py)."""
    check_sglang_version()
    return _apply(CPU_PATCHES)


def _apply(names: tuple[str, ...]) -> list[str]:
    for name in names:
        if name not in _applied:
            importlib.import_module(f"sglang_ext.patches.{name}").apply()
            _applied.append(name)
    logger.debug("sglang_ext applied patches: %s", _applied)
    return list(_applied)


def applied_patches() -> list[str]:
    return list(_applied)
