"""Start-up checks of Tail-Replay against the server's other flags, and the summary line.

Pure: a function of the Tail-Replay config and a few server facts (`ServerFacts`), giving either
the summary line(s) to log or a `StartupError` naming both sides of a refused combination. The
same facts decide which per-request overrides a server refuses (`request_limits`), so a request
cannot ask for a combination the server was refused at start-up, or one it has no room for.

Called in the main process before SGLang starts its schedulers (`sglang_ext.launcher`, and the
plugin's hook on `ServerArgs.resolve_once`; flags only), and again in every scheduler by
`tail_replay_cache_factory` (`check_scheduler_start`), which sees the KV cache dtype SGLang
resolved (`--kv-cache-dtype auto` is fp8 for checkpoints that ask for an fp8 KV cache; such a
server must name the dtype in the flag, because requests are checked against the flag) and logs
the summary on TP rank 0. No SGLang import here: the adapters read duck-typed SGLang objects.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from typing import Any

from sglang_ext.env import rust_server
from sglang_ext.tail_replay.config import AUTO, TailReplayConfig, user_settings
from sglang_ext.tail_replay.decay_profile import PROFILE_FILE, certified_window
from sglang_ext.tail_replay.request_fields import RequestLimits

logger = logging.getLogger(__name__)

#: KV cache dtypes (SGLang's `--kv-cache-dtype` values, or torch dtype names) that store K/V at
#: 16 or 32 bits; every other value (fp8_e4m3, fp8_e5m2, mxfp8, nvfp4, ...) is a quantized cache.
UNQUANTIZED_KV_DTYPES = ("auto", "bf16", "bfloat16", "fp16", "float16", "half", "fp32", "float32", "float")


class StartupError(ValueError):
    """A combination of Tail-Replay config and server flags that cannot run; names both."""


@dataclass(frozen=True)
class ServerFacts:
    #: `--kv-cache-dtype` (main process) or the dtype SGLang resolved for the KV pool (scheduler)
    kv_cache_dtype: str = "auto"
    #: `--model-path` (where `budget: "auto"` looks for the decay profile)
    model_path: str = ""
    #: `--enable-hierarchical-cache`
    hierarchical_cache: bool = False
    #: `--hicache-host-memory-mode` (SGLang's default "cache")
    hicache_host_memory_mode: str = "cache"
    #: `--hicache-storage-backend` (None: no storage tier)
    hicache_storage_backend: str | None = None
    #: `SGLANG_RUST_SERVER`: SGLang's Rust HTTP server and tokenizer replace the Python ones
    rust_server: bool = False


def kv_cache_is_quantized(kv_cache_dtype: str) -> bool:
    name = str(kv_cache_dtype).removeprefix("torch.")
    return name not in UNQUANTIZED_KV_DTYPES


def request_limits(config: TailReplayConfig, facts: ServerFacts) -> RequestLimits:
    """Which overrides this server refuses, and why (the reason goes into the HTTP 400)."""
    checkpoints = None
    if not config.knobs.keep_checkpoints:
        checkpoints = ("it runs with the Tail-Replay config keep_checkpoints false, so its state pool "
                       "holds one slot per running request and has none for a checkpoint")
    exact = None
    if kv_cache_is_quantized(facts.kv_cache_dtype):
        exact = (f"its KV cache is quantized (--kv-cache-dtype {facts.kv_cache_dtype}); exact-KV replay "
                 "needs an unquantized KV cache, so only kv_mode 'recompute' runs here")
    return RequestLimits(checkpoints_refused=checkpoints, exact_kv_refused=exact)


def check_start(config: TailReplayConfig, facts: ServerFacts) -> list[str]:
    """The summary line(s) for this server, or StartupError for a combination that cannot run."""
    if facts.rust_server:
        raise StartupError(
            "SGLANG_RUST_SERVER (SGLang's Rust HTTP server and tokenizer) cannot run with the extension's cache "
            "backends: their request checks (a bad field is a 400 naming it; the fields the server sets on its own "
            "runs are refused from clients) and the other wings' arrival seams run in SGLang's Python tokenizer "
            "process, which the Rust server replaces, so requests would reach the scheduler unchecked; unset "
            "SGLANG_RUST_SERVER")
    if facts.hierarchical_cache and facts.hicache_host_memory_mode != "cache":
        raise StartupError(
            f"--hicache-host-memory-mode {facts.hicache_host_memory_mode} cannot run with Tail-Replay's cache: "
            "its staging pipeline loads host KV outside the load-back the replay planner plans (the request's "
            "prefix would not be the plan's); use --hicache-host-memory-mode cache (the default)")
    if config.knobs.kv_mode == "exact" and kv_cache_is_quantized(facts.kv_cache_dtype):
        raise StartupError(
            f"--kv-cache-dtype {facts.kv_cache_dtype} (a quantized KV cache) cannot run with the "
            "Tail-Replay config kv_mode 'exact' (the default), which copies the tree's cached K/V into "
            "the forward unquantized; set kv_mode 'recompute' in --tail-replay-config / "
            "SGLANG_EXT_TAIL_REPLAY_CONFIG, or use an unquantized --kv-cache-dtype")
    if config.knobs.budget == AUTO and config.server.profile is None:
        raise StartupError(
            f"the Tail-Replay config budget {AUTO!r} needs the model's decay profile, and there is none: "
            f"no {PROFILE_FILE} in --model-path {facts.model_path!r} and no 'decay_profile' key (write one with "
            f"`python -m eval.training.decay --model {facts.model_path or 'MODEL_DIR'}`)")
    return [summary_line(config, facts)]


def check_flag_names_kv_dtype(flag: ServerFacts, resolved: ServerFacts) -> None:
    """Refuse a quantized KV cache that the flags do not name (`--kv-cache-dtype auto` that SGLang
    resolved from the checkpoint's quantization config): requests are checked in the tokenizer
    process, which sees only the flag, so it must name the quantized dtype."""
    if kv_cache_is_quantized(resolved.kv_cache_dtype) and not kv_cache_is_quantized(flag.kv_cache_dtype):
        raise StartupError(
            f"--kv-cache-dtype {flag.kv_cache_dtype} gave a quantized KV cache ({resolved.kv_cache_dtype}, from the "
            "checkpoint's quantization config); with --radix-cache-backend tail_replay pass the quantized "
            "--kv-cache-dtype explicitly (e.g. fp8_e4m3), so that requests asking for kv_mode 'exact' are refused "
            "when they arrive")


def summary_line(config: TailReplayConfig, facts: ServerFacts) -> str:
    settings = " ".join(f"{k}={v!r}" for k, v in user_settings(config).items())
    if config.server.profile is not None:
        decay = config.server.profile.decay(config.knobs.decay_percentile)
        window = certified_window(decay, config.knobs.tolerance)
        settings += (f"; decay profile: slowest head's p{config.knobs.decay_percentile} decay {decay:.5f}, "
                     f"certified window for tolerance {config.knobs.tolerance:g}: "
                     f"{'none (a head that does not forget)' if window is None else f'{window} tokens'}")
    limits = request_limits(config, facts)
    reasons = [f"keep_checkpoints=true ({limits.checkpoints_refused})" if limits.checkpoints_refused else None,
               f"kv_mode='exact' ({limits.exact_kv_refused})" if limits.exact_kv_refused else None]
    refused = [r for r in reasons if r] or ["none"]
    storage = (f"; storage tier {facts.hicache_storage_backend}: the attention KV of strictly exact nodes "
               "only (no states)" if facts.hierarchical_cache and facts.hicache_storage_backend else "")
    return (f"Tail-Replay config in force: {settings}; kv cache dtype {facts.kv_cache_dtype}; "
            f"per-request overrides refused: {'; '.join(refused)}{storage}")


# ------------------------------------------------------------------ one byte budget by default

#: full-attention backends whose kernels read SGLang 0.5.23's unified pool through its id
#: translation (its page-major allow-list, `kv_cache_hook.handle_page_major_kv_layout`, for MHA
#: models), and the CPU server's `torch_native` (`patches/cpu/unified_memory.py`); None: SGLang picks
UNIFIED_ATTENTION_BACKENDS = ("triton", "fa3", "fa4", "flashinfer", "trtllm_mha", "torch_native")
#: linear-attention backends it admits for the strided state, decode and prefill (SGLang's sets)
UNIFIED_LINEAR_DECODE = ("triton", "flashinfer")
UNIFIED_LINEAR_PREFILL = ("triton", "flashkda", "flashinfer")


@dataclass(frozen=True)
class PoolFacts:
    """The server flags (as given, before SGLang resolves them) that decide whether Tail-Replay
    runs on one byte budget (`unified_memory_default`)."""

    #: `--enable-unified-memory` given by the operator
    unified_memory: bool = False
    #: `--disaggregation-mode` ("null": none)
    disaggregation_mode: str = "null"
    #: `--enable-kv-cache-sharding`
    kv_cache_sharding: bool = False
    #: `--speculative-algorithm`
    speculative_algorithm: str | None = None
    #: `--attention-backend`, `--prefill-attention-backend`, `--decode-attention-backend` (None: unset)
    attention_backends: tuple[str | None, ...] = ()
    #: `--linear-attn-backend`, `--linear-attn-decode-backend`, `--linear-attn-prefill-backend`
    linear_attn_backends: tuple[str | None, str | None, str | None] = (None, None, None)
    #: `--mamba-backend`
    mamba_backend: str | None = None
    #: `--kv-cache-dtype`
    kv_cache_dtype: str = "auto"
    #: `--enable-hierarchical-cache`
    hierarchical_cache: bool = False
    #: where no attention backend is named: whether the one SGLang picks reads the unified pool (on
    #: an NVIDIA GPU it picks among fa3 / fa4 / flashinfer / triton / trtllm_mha; elsewhere, e.g.
    #: aiter on ROCm, not known here; the CPU launcher names `torch_native`)
    picked_backend_admitted: bool = True


def unified_memory_default(config: TailReplayConfig, facts: PoolFacts) -> str | None:
    """Whether the server runs on one byte budget: SGLang's unified memory (`--enable-unified-memory`:
    the KV pool and the state pool are views over one byte buffer, the split follows the workload,
    and Tail-Replay's eviction frees the states worth less per byte than KV first,
    `byte_budget.ByteBudget`). Returns None where it does (the operator's flag, or the default),
    else why the server keeps SGLang's static pools: the config's `byte_budget: false`, a
    combination SGLang 0.5.23 refuses with the unified pool (a quantized FP4 KV cache, KV
    sharding, backends outside its allow-lists), or one that never ran with it here (HiCache, PD
    disaggregation, speculative decoding). Pure."""
    if facts.unified_memory:
        return None
    if not config.server.byte_budget:
        return "the Tail-Replay config sets byte_budget false"
    dtype = str(facts.kv_cache_dtype).lower()
    linear, decode, prefill = facts.linear_attn_backends
    reasons = (
        (facts.hierarchical_cache, "--enable-hierarchical-cache: HiCache with the unified pool never ran with "
                                   "Tail-Replay (on CPU SGLang moves it to its CUDA copy kernels)"),
        (facts.disaggregation_mode not in ("null", "", None),
         f"--disaggregation-mode {facts.disaggregation_mode}: the extra buffer's transfer with the unified "
         "pool never ran"),
        (facts.kv_cache_sharding, "--enable-kv-cache-sharding: SGLang refuses it with --enable-unified-memory"),
        ("fp4" in dtype, f"--kv-cache-dtype {facts.kv_cache_dtype}: SGLang's unified pool has no FP4 KV cache"),
        (facts.speculative_algorithm is not None,
         f"--speculative-algorithm {facts.speculative_algorithm}: speculative decoding with the unified pool "
         "never ran with Tail-Replay"),
        (not any(facts.attention_backends) and not facts.picked_backend_admitted,
         "no --attention-backend given, and the one SGLang picks on this platform is not known to read the "
         f"unified pool (name one of {', '.join(UNIFIED_ATTENTION_BACKENDS)})"),
        (any(b is not None and b not in UNIFIED_ATTENTION_BACKENDS for b in facts.attention_backends),
         f"attention backend {[b for b in facts.attention_backends if b]}: not one that reads the unified pool "
         f"({', '.join(UNIFIED_ATTENTION_BACKENDS)})"),
        (any(b is not None and b not in UNIFIED_LINEAR_DECODE for b in (linear, decode))
         or (prefill is not None and prefill not in UNIFIED_LINEAR_PREFILL),
         f"linear-attention backend {[b for b in facts.linear_attn_backends if b]}: not one SGLang admits for "
         "the unified pool's strided state"),
        (facts.mamba_backend not in (None, "triton"),
         f"--mamba-backend {facts.mamba_backend}: SGLang's unified pool needs the Triton Mamba kernels"),
    )
    return next((why for refused, why in reasons if refused), None)


def pool_facts_from_server_args(server_args: Any) -> PoolFacts:
    """PoolFacts from SGLang's ServerArgs (flags as given, before resolution)."""
    def flag(name: str) -> Any:
        return getattr(server_args, name, None)

    return PoolFacts(unified_memory=bool(flag("enable_unified_memory")),
                     disaggregation_mode=str(flag("disaggregation_mode") or "null"),
                     kv_cache_sharding=bool(flag("enable_kv_cache_sharding")),
                     speculative_algorithm=flag("speculative_algorithm") or None,
                     attention_backends=tuple(flag(n) or None for n in ("attention_backend", "prefill_attention_backend",
                                                                        "decode_attention_backend")),
                     linear_attn_backends=(flag("linear_attn_backend") or None, flag("linear_attn_decode_backend") or None,
                                           flag("linear_attn_prefill_backend") or None),
                     mamba_backend=flag("mamba_backend") or None,
                     kv_cache_dtype=str(flag("kv_cache_dtype") or "auto"),
                     hierarchical_cache=bool(flag("enable_hierarchical_cache")),
                     picked_backend_admitted=_nvidia_gpu())


def _nvidia_gpu() -> bool:
    import torch

    return bool(torch.cuda.is_available() and getattr(torch.version, "hip", None) is None)


def apply_unified_memory_default(server_args: Any, config: TailReplayConfig) -> str:
    """Main process, before SGLang resolves `server_args`: turn on `--enable-unified-memory` where
    `unified_memory_default` says so. Returns the line saying which pools the server runs on.
    May mutate: `server_args.enable_unified_memory`."""
    why = unified_memory_default(config, pool_facts_from_server_args(server_args))
    if why is None and not getattr(server_args, "enable_unified_memory", False):
        server_args.enable_unified_memory = True
    return pools_line(config, server_args)


def pools_line(config: TailReplayConfig, server_args: Any) -> str:
    """Which pools the server runs on, and why (the start-up log)."""
    if getattr(server_args, "enable_unified_memory", False):
        eviction = "Tail-Replay's byte_budget eviction" if config.server.byte_budget else "SGLang's eviction"
        return f"Tail-Replay pools: one byte budget (SGLang's --enable-unified-memory; {eviction})"
    why = unified_memory_default(config, pool_facts_from_server_args(server_args))
    return f"Tail-Replay pools: SGLang's static KV and state pools ({why or '--enable-unified-memory was not set'})"

# ------------------------------------------------------------------ adapters (duck-typed)

def facts_from_server_args(server_args: Any) -> ServerFacts:
    """Facts from SGLang's ServerArgs (flags as given; main process or tokenizer)."""
    return ServerFacts(kv_cache_dtype=str(getattr(server_args, "kv_cache_dtype", None) or "auto"),
                       model_path=str(getattr(server_args, "model_path", None) or ""),
                       hierarchical_cache=bool(getattr(server_args, "enable_hierarchical_cache", False)),
                       hicache_host_memory_mode=str(getattr(server_args, "hicache_host_memory_mode", None) or "cache"),
                       hicache_storage_backend=getattr(server_args, "hicache_storage_backend", None) or None,
                       rust_server=rust_server())


def check_scheduler_start(ctx: Any, config: TailReplayConfig) -> None:
    """In each scheduler, from SGLang's TreeCacheBuildContext: refuse what cannot run (with the
    KV dtype SGLang resolved), and log the summary line once, on TP rank 0."""
    flag = facts_from_server_args(ctx.server_args)
    runner = getattr(getattr(ctx, "tp_worker", None), "model_runner", None)
    resolved = getattr(runner, "kv_cache_dtype", None)
    facts = (dataclasses.replace(flag, kv_cache_dtype=str(resolved).removeprefix("torch."))
             if resolved is not None else flag)
    lines = [*check_start(config, facts), pools_line(config, ctx.server_args)]
    check_flag_names_kv_dtype(flag, facts)
    if getattr(ctx, "tp_rank", 0) == 0:
        for line in lines:
            logger.info(line)
