"""Version-guarded runtime patches to SGLang 0.5.23, applied before SGLang is imported.

Each module in this package patches one SGLang seam and names the file it targets
(`TARGET`). `apply_patches(mode)` checks the installed SGLang version first, then applies:

- mode "cpu": the CPU patch set (stand-in `sgl_kernel` CPU ops, driverless-CUDA-torch fixes,
  torch fallbacks for Triton-only paths, O(new x context) extend attention, stock HiCache's host
  tier: unpinned host pools and torch `direct` copies, `cpu_hicache`; `--enable-deterministic-inference`
  with batch-invariant matrix products, `cpu_deterministic`), then the extension's own
  seams;
- mode "gpu": only the extension's own seams and the request check (`request_token_ids`);
  SGLang's fast paths stay untouched.

The extension's own seams (`EXT_PATCHES`) are Tail-Replay's, one SGLang function each; they reach
the wing only through its public face, `sglang_ext.tail_replay` (whose docstring walks a
request through them): `tail_replay_request` (request check on arrival), `tail_replay_sizing` and
`tail_replay_pages` (start-up: state-pool size, pages > 1), `tail_replay_host_pools` (start-up,
HiCache: the whole host budget to KV, the host tier holds no states), `tail_replay_batch` (tail rows per
forward batch, metrics), `tail_replay_attention` and `tail_replay_prefill_graph` (exact cached K/V
for the tail), `tail_replay_gdn_bound` and `tail_replay_mamba2_bound` (each approximate replay's
state bound from its tail's gates), `tail_replay_meta` (the per-request summaries in meta_info,
Tail-Replay's and LinearKV's), `ipc_json` (request fields and
those summaries across SGLang's IPC in both modes; after the audit's patch, so its decoding runs
first), `tail_replay_audit` (the live quality audit: the first output's
logits of audited requests, their exact reference runs sent by the tokenizer process),
`tail_replay_session` (a finished streaming-session turn's own recomputed tail is freed when its
row goes to the session), `tail_replay_disagg` (PD disaggregation: the prefill server's answer
label carried to the decode server in one more metadata buffer), `tail_replay_pressure` (`exact_unless_pressed`: the first rank stamps each
request with the pressure decision before SGLang broadcasts it to the other ranks),
`linearkv_request` (LinearKV: chunks found and registered on arrival), `linearkv_prepass`
(LinearKV: EPIC's chunk heads recomputed in the worker before the question's forward),
`linearkv_admission` (LinearKV: every admission round's state slots budgeted, loads included),
`session_tenancy` (a session belongs to its first turn's cache namespace; a turn from another
is refused, on every backend).
Three fixes to SGLang itself ride with them, because they hit GPUs too: `mamba_conv_dtype` (the
linear layers' conv-window state in the model's dtype, not a fixed bfloat16, which the `extra_buffer`
strategy's tracking copy requires), `seeded_sampling` (under `--enable-deterministic-inference`, a
seeded request samples the same token whether or not another request of its batch filters with
top-k, top-p or greedy) and `session_storage_prefetch` (a streaming session's turn on a server with
HiCache's storage tier: the storage prefetch asked the tree about the session slot's stand-in node,
and the scheduler died).

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
    "sgl_kernel_stub",      # must come first: SGLang imports sgl_kernel at import time
    "device_module",
    "cpu_norm",
    "cpu_elementwise",
    "cpu_gdn",
    "extend_attention",
    "cpu_mamba2",
    "cpu_moe",
    "cpu_nemotron_h_router",
    "cpu_memory_budget",
    "cpu_pin_memory",
    "cpu_hicache",          # HiCache host tier: unpinned host pools, torch `direct` copies, RAM reserve
    "cpu_start_method",     # SGLANG_EXT_CPU_START_METHOD=fork: children forked, not spawned
    "cpu_mamba_track",
    "cpu_extra_buffer",     # after cpu_gdn / cpu_mamba2: the ops extra_buffer reads
    "cpu_deterministic",    # --enable-deterministic-inference: torch_native admitted, row-by-row mm
)
#: Applied in both modes (the extension's own seams).
EXT_PATCHES: tuple[str, ...] = ("tail_replay_batch", "tail_replay_attention", "tail_replay_prefill_graph",
                                "tail_replay_gdn_bound", "tail_replay_mamba2_bound", "tail_replay_meta",
                                "tail_replay_audit", "ipc_json", "tail_replay_request", "tail_replay_pressure", "tail_replay_session",
                                "session_tenancy", "tail_replay_sizing", "tail_replay_pages", "tail_replay_host_pools",
                                "request_token_ids", "linearkv_request", "linearkv_prepass", "linearkv_admission",
                                "sae_policy", "sae_tree_core", "sae_cache_events", "sae_full_eviction", "sae_state_eviction", "sae_request", "sae_chat",
                                "mamba_conv_dtype", "seeded_sampling", "session_storage_prefetch", "tail_replay_disagg")

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
