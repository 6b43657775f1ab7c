"""Every environment variable the extension reads, in one place.

Child processes of the SGLang server inherit these, which is how the launcher tells them
to apply the runtime patches before SGLang is imported (processes are started with spawn).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

#: "cpu" -> apply the CPU patch set; "gpu" -> only the extension's own seams; unset -> none.
PATCH_MODE_VAR = "SGLANG_EXT_PATCH_MODE"
#: Set to 1 to let the extension start on an SGLang version other than the supported one.
ALLOW_OTHER_SGLANG_VAR = "SGLANG_EXT_ALLOW_OTHER_SGLANG"
#: Tail-Replay configuration: a JSON object, or the path of a JSON file (see tail_replay/config.py).
TAIL_REPLAY_CONFIG_VAR = "SGLANG_EXT_TAIL_REPLAY_CONFIG"
#: LinearKV server configuration (`--linearkv-config`): a JSON object (see linearkv/serving.py).
LINEARKV_CONFIG_VAR = "SGLANG_EXT_LINEARKV_CONFIG"
#: Read by SGLang itself; required for its CPU engine.
SGLANG_CPU_ENGINE_VAR = "SGLANG_USE_CPU_ENGINE"
#: Read by HF tokenizers: its own thread pool, which must be off in forked data-loader workers.
TOKENIZERS_PARALLELISM_VAR = "TOKENIZERS_PARALLELISM"
#: CPU serving threads: unset or "auto" -> the launcher's defaults (launcher.cpu_thread_env);
#: an integer N -> N compute threads; "keep" -> export nothing (SGLang/torch/OpenMP defaults).
CPU_THREADS_VAR = "SGLANG_EXT_CPU_THREADS"
#: Read by OpenMP / MKL / torch: compute threads per process, and how idle OpenMP threads wait.
OMP_NUM_THREADS_VAR = "OMP_NUM_THREADS"
MKL_NUM_THREADS_VAR = "MKL_NUM_THREADS"
OMP_WAIT_POLICY_VAR = "OMP_WAIT_POLICY"
#: GNU OpenMP (the runtime torch's Linux wheels use): busy-wait iterations before sleeping.
GOMP_SPINCOUNT_VAR = "GOMP_SPINCOUNT"
#: Intel OpenMP (if torch was built against it): milliseconds a thread spins after a parallel region.
KMP_BLOCKTIME_VAR = "KMP_BLOCKTIME"
#: How the CPU server starts its children (scheduler, detokenizer): "spawn" (SGLang's way, the
#: default; each child imports SGLang again and re-applies the patches through
#: `sglang_ext.spawn_main`) or "fork" (the children are copies of the launcher, which has
#: imported SGLang and applied the patches already: the tiny fixture's server is ready ~1.6x sooner,
#: benchmarks/start_method.py; CPU only, since CUDA cannot be forked).
CPU_START_METHOD_VAR = "SGLANG_EXT_CPU_START_METHOD"
CPU_START_METHODS = ("spawn", "fork")
#: every thread setting the CPU launcher decides (recorded by the benchmarks)
THREAD_VARS = (CPU_THREADS_VAR, OMP_NUM_THREADS_VAR, MKL_NUM_THREADS_VAR, OMP_WAIT_POLICY_VAR,
               GOMP_SPINCOUNT_VAR, KMP_BLOCKTIME_VAR)


@dataclass(frozen=True)
class ExtEnv:
    patch_mode: str | None
    allow_other_sglang: bool


def read_env() -> ExtEnv:
    mode = os.environ.get(PATCH_MODE_VAR) or None
    if mode not in (None, "cpu", "gpu"):
        raise ValueError(f"{PATCH_MODE_VAR}={mode!r}: expected 'cpu' or 'gpu'")
    allow = os.environ.get(ALLOW_OTHER_SGLANG_VAR, "0") not in ("", "0", "false")
    return ExtEnv(patch_mode=mode, allow_other_sglang=allow)


def cpu_start_method() -> str:
    """`SGLANG_EXT_CPU_START_METHOD`: "spawn" (unset) or "fork"; anything else is an error naming it."""
    value = os.environ.get(CPU_START_METHOD_VAR) or "spawn"
    if value not in CPU_START_METHODS:
        raise ValueError(f"{CPU_START_METHOD_VAR}={value!r}: expected one of {', '.join(CPU_START_METHODS)}")
    return value


#: Read by SGLang: its Rust HTTP server and tokenizer instead of the Python ones
SGLANG_RUST_SERVER_VAR = "SGLANG_RUST_SERVER"


def rust_server() -> bool:
    """Whether `SGLANG_RUST_SERVER` asks for SGLang's Rust HTTP server (as SGLang's `EnvBool` reads
    it: "true" / "1" / "yes" / "y", any case)."""
    return os.environ.get(SGLANG_RUST_SERVER_VAR, "").strip().lower() in ("true", "1", "yes", "y")


def tail_replay_config_text() -> str | None:
    """The raw value of `SGLANG_EXT_TAIL_REPLAY_CONFIG` (None when unset). Parsed, validated and
    cached by `sglang_ext.tail_replay.config.server_config` (this module imports no wing)."""
    return os.environ.get(TAIL_REPLAY_CONFIG_VAR)


def linearkv_config_text() -> str | None:
    """The raw value of `SGLANG_EXT_LINEARKV_CONFIG` (None when unset); parsed by
    `sglang_ext.linearkv.serving.parse_config`."""
    return os.environ.get(LINEARKV_CONFIG_VAR)


def export_linearkv_config(text: str) -> None:
    os.environ[LINEARKV_CONFIG_VAR] = text


def export_tail_replay_config(text: str) -> None:
    os.environ[TAIL_REPLAY_CONFIG_VAR] = text


def export_patch_mode(mode: str) -> None:
    """Make `mode` visible to this process and every child it spawns."""
    os.environ[PATCH_MODE_VAR] = mode
    if mode == "cpu":
        os.environ[SGLANG_CPU_ENGINE_VAR] = "1"


def export_cpu_thread_env(values: dict[str, str]) -> None:
    """Export the CPU thread settings the launcher chose (it only chooses unset variables)."""
    for var, value in values.items():
        os.environ.setdefault(var, value)


def export_tokenizers_single_threaded() -> None:
    """Before forking data-loader workers: HF tokenizers' thread pool does not survive a fork."""
    os.environ.setdefault(TOKENIZERS_PARALLELISM_VAR, "false")
