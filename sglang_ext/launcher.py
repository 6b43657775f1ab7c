"""`sglang-ext serve`: start the patched SGLang server with every `sglang serve` argument.

On a machine without a usable GPU (or with `--device cpu`) it applies the CPU patch set
and fills in CPU defaults the user did not give; on a GPU it applies only the extension's
own seams and leaves SGLang's arguments and fast paths alone.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from sglang_ext.env import (
    CPU_START_METHOD_VAR,
    CPU_THREADS_VAR,
    GOMP_SPINCOUNT_VAR,
    KMP_BLOCKTIME_VAR,
    MKL_NUM_THREADS_VAR,
    OMP_NUM_THREADS_VAR,
    OMP_WAIT_POLICY_VAR,
    cpu_start_method,
    export_cpu_thread_env,
    export_patch_mode,
    export_tail_replay_config,
)

#: flag -> value added on CPU unless the user passed the flag (value None: a bare switch)
CPU_DEFAULTS: dict[str, str | None] = {
    "--device": "cpu",
    "--attention-backend": "torch_native",
    "--max-total-tokens": "65536",
    "--max-mamba-cache-size": "32",
    "--max-running-requests": "16",
    "--chunked-prefill-size": "4096",
    "--mem-fraction-static": "0.1",
    "--sleep-on-idle": None,
    "--disable-overlap-schedule": None,
    "--enable-metrics": None,
}

#: attention backends that can run on the CPU engine
CPU_ATTENTION_BACKENDS = ("torch_native", "intel_amx")

#: HiCache (the host tier, `--enable-hierarchical-cache` / `--enable-hicache`) on CPU: the `direct`
#: io backend, whose copies patches/cpu/hicache.py provides in torch (the `kernel` one is
#: CUDA kernels, `kernel_ascend` NPU ones), and a host layout those copies serve. `page_first_direct`
#: is the default because SGLang's Mamba host pool (hybrid models) takes only page-first layouts;
#: `page_first` SGLang itself rewrites to `page_first_direct` under `direct`; `layer_first` serves
#: attention-only models.
HICACHE_FLAGS = ("--enable-hierarchical-cache", "--enable-hicache")
CPU_HICACHE_DEFAULTS: dict[str, str] = {
    "--hicache-io-backend": "direct",
    "--hicache-mem-layout": "page_first_direct",
}
CPU_HICACHE_CHOICES: dict[str, tuple[str, ...]] = {
    "--hicache-io-backend": ("direct",),
    "--hicache-mem-layout": ("page_first_direct", "page_first", "layer_first"),
}


class LaunchError(ValueError):
    """A bad launcher argument; the message names it."""


#: OpenMP waiting on CPU: idle threads sleep at once instead of spinning (GNU OpenMP spins ~300k
#: iterations by default, Intel's 200 ms), so a thread that waits at a barrier for a sibling the
#: kernel has preempted (a neighbour on the cores) hands the core to it instead of burning it.
#: An explicit GOMP_SPINCOUNT from the user wins over the policy in GNU OpenMP.
CPU_WAIT_ENV: dict[str, str] = {
    OMP_WAIT_POLICY_VAR: "PASSIVE",
    GOMP_SPINCOUNT_VAR: "0",
    KMP_BLOCKTIME_VAR: "0",
}


def cpu_threads(cpu_count: int) -> int:
    """Compute threads per server process by default: every core the process may run on.
    With passive waits a thread that has no core costs nothing; measured on a busy 2-core
    machine (benchmarks/README.md, `cpu_neighbour.py`) 2 passive threads were as fast as or
    faster than 1 (cores - 1) in every median, alone and beside two busy neighbours."""
    return max(1, cpu_count)


def cpu_thread_env(user_env: Mapping[str, str], cpu_count: int) -> dict[str, str]:
    """The thread variables the CPU launcher exports: only those `user_env` leaves unset.

    Thread count: `SGLANG_EXT_CPU_THREADS` (in `user_env`) if it is an integer N >= 1; else a
    count the user already gave in MKL_NUM_THREADS or OMP_NUM_THREADS (torch's intra-op default
    follows MKL_NUM_THREADS over OMP_NUM_THREADS, so both must agree: a user's OMP_NUM_THREADS=1
    alone must not become 2 threads through an exported MKL_NUM_THREADS); else
    `cpu_threads(cpu_count)`. It goes to whichever of the two variables is unset, and the wait
    policy (CPU_WAIT_ENV) likewise, variable by variable. `SGLANG_EXT_CPU_THREADS=keep` exports
    nothing (torch / OpenMP defaults: every core, spinning waits); unset or "auto" is the default.
    Raises LaunchError naming the variable on a bad value."""
    raw = (user_env.get(CPU_THREADS_VAR) or "auto").strip().lower()
    if raw == "keep":
        return {}
    if raw == "auto":
        given = user_env.get(MKL_NUM_THREADS_VAR) or user_env.get(OMP_NUM_THREADS_VAR)
        threads = given.strip() if given else str(cpu_threads(cpu_count))
    else:
        try:
            count = int(raw)
        except ValueError:
            count = 0
        if count < 1:
            raise LaunchError(f"{CPU_THREADS_VAR}={user_env.get(CPU_THREADS_VAR)!r}: expected 'auto', "
                              f"'keep' or a thread count >= 1")
        threads = str(count)
    wanted = {OMP_NUM_THREADS_VAR: threads, MKL_NUM_THREADS_VAR: threads, **CPU_WAIT_ENV}
    return {var: value for var, value in wanted.items() if not user_env.get(var)}


@dataclass(frozen=True)
class LaunchPlan:
    mode: str                 # "cpu" or "gpu"
    argv: list[str]           # arguments passed on to SGLang


def _flag_value(argv: list[str], flag: str) -> str | None:
    for i, arg in enumerate(argv):
        if arg == flag and i + 1 < len(argv):
            return argv[i + 1]
        if arg.startswith(flag + "="):
            return arg.split("=", 1)[1]
    return None


def _has_flag(argv: list[str], flag: str) -> bool:
    return any(a == flag or a.startswith(flag + "=") for a in argv)


def _gpu_available() -> bool:
    import torch

    return torch.cuda.is_available()


def plan_launch(argv: list[str], gpu_available: bool | None = None) -> LaunchPlan:
    """Decide CPU or GPU mode and the final SGLang argv; raise LaunchError on bad flags."""
    if not _has_flag(argv, "--model-path"):
        raise LaunchError("--model-path is required")
    device = _flag_value(argv, "--device")
    gpu = _gpu_available() if gpu_available is None else gpu_available
    if device not in (None, "cpu") and not gpu:
        raise LaunchError(f"--device {device} was given but no GPU is usable on this machine")
    if device == "cpu" or (device is None and not gpu):
        return LaunchPlan("cpu", _with_cpu_defaults(argv))
    return LaunchPlan("gpu", list(argv))


def _with_cpu_defaults(argv: list[str]) -> list[str]:
    backend = _flag_value(argv, "--attention-backend")
    if backend is not None and backend not in CPU_ATTENTION_BACKENDS:
        raise LaunchError(
            f"--attention-backend {backend} is GPU-only; on CPU use one of {CPU_ATTENTION_BACKENDS}"
        )
    out = list(argv)
    for flag, value in CPU_DEFAULTS.items():
        if not _has_flag(argv, flag):
            out += [flag] if value is None else [flag, value]
    if any(_has_flag(argv, flag) for flag in HICACHE_FLAGS):
        out += _cpu_hicache_args(argv)
    return out


def _cpu_hicache_args(argv: list[str]) -> list[str]:
    """The HiCache flags to add on CPU (CPU_HICACHE_DEFAULTS the user did not give); a user's value
    the CPU engine cannot run is refused by name."""
    out = []
    for flag, default in CPU_HICACHE_DEFAULTS.items():
        value = _flag_value(argv, flag)
        if value is None:
            out += [flag, default]
        elif value not in CPU_HICACHE_CHOICES[flag]:
            raise LaunchError(f"{flag} {value} does not run on CPU with --enable-hierarchical-cache; "
                              f"use one of {CPU_HICACHE_CHOICES[flag]} (default {default})")
    return out


#: the extension's own flags, taken out of argv before SGLang parses it
TAIL_REPLAY_CONFIG_FLAG = "--tail-replay-config"
LINEARKV_CONFIG_FLAG = "--linearkv-config"


def _pop_flag(argv: list[str], flag: str) -> tuple[list[str], str | None]:
    value = _flag_value(argv, flag)
    if value is None and _has_flag(argv, flag):
        raise LaunchError(f"{flag} needs a value")
    out, skip = [], False
    for arg in argv:
        if skip:
            skip = False
        elif arg == flag:
            skip = True
        elif not arg.startswith(flag + "="):
            out.append(arg)
    return out, value


def _export_config(text: str | None, parse: Callable[[str], object], error: type[Exception],
                   export: Callable[[str], None]) -> None:
    """A config flag's JSON: validated here (a clear error naming the key before SGLang starts),
    then handed to every process."""
    if text is None:
        return
    try:
        parse(text)
    except error as exc:
        raise LaunchError(str(exc)) from None
    export(text)


def _export_tail_replay_config(text: str | None) -> None:
    """`--tail-replay-config` (see tail_replay/config.py)."""
    from sglang_ext.tail_replay import TailReplayConfigError, parse_config

    _export_config(text, parse_config, TailReplayConfigError, export_tail_replay_config)


def _export_linearkv_config(text: str | None) -> None:
    """`--linearkv-config` (see linearkv/serving.py)."""
    from sglang_ext.env import export_linearkv_config
    from sglang_ext.linearkv import LinearKVConfigError, parse_server_config

    _export_config(text, parse_server_config, LinearKVConfigError, export_linearkv_config)


def _check_tail_replay_start(server_args) -> None:
    """With `--radix-cache-backend tail_replay`: the config (flag or env) against the server's
    flags, once, before SGLang starts a scheduler (see tail_replay/startup.py)."""
    from sglang_ext.plugin import check_main_process, selects_tail_replay

    if selects_tail_replay(server_args):
        try:
            check_main_process(server_args)
        except ValueError as exc:
            raise LaunchError(str(exc)) from None


def _use_cpu_threads(values: dict[str, str]) -> None:
    """Export `values` to the server's children (spawned later: the scheduler, the detokenizer,
    which read them when they load OpenMP), and apply the thread count to this process, whose
    OpenMP runtime torch has already loaded."""
    export_cpu_thread_env(values)
    if OMP_NUM_THREADS_VAR in values:
        import torch

        torch.set_num_threads(int(values[OMP_NUM_THREADS_VAR]))


def _check_start_method(mode: str) -> None:
    """`SGLANG_EXT_CPU_START_METHOD` (see sglang_ext/env.py): a known value, and fork only on CPU."""
    try:
        method = cpu_start_method()
    except ValueError as exc:
        raise LaunchError(str(exc)) from None
    if method == "fork" and mode != "cpu":
        raise LaunchError(f"{CPU_START_METHOD_VAR}=fork is for the CPU server only (CUDA cannot be forked); unset it")


def serve(argv: list[str]) -> None:
    """Apply patches for the chosen mode, then run SGLang's own server entry point."""
    argv, tail_replay_config = _pop_flag(argv, TAIL_REPLAY_CONFIG_FLAG)
    _export_tail_replay_config(tail_replay_config)
    argv, linearkv_config = _pop_flag(argv, LINEARKV_CONFIG_FLAG)
    _export_linearkv_config(linearkv_config)
    plan = plan_launch(argv)
    _check_start_method(plan.mode)
    export_patch_mode(plan.mode)
    if plan.mode == "cpu":
        _use_cpu_threads(cpu_thread_env(os.environ, len(os.sched_getaffinity(0))))
    from sglang_ext.patches import apply_patches
    from sglang_ext.spawn_main import use_as_spawn_main

    apply_patches(plan.mode)
    use_as_spawn_main()
    from sglang.launch_server import run_server
    from sglang.srt.plugins import load_plugins
    from sglang.srt.server_args import prepare_server_args
    from sglang.srt.utils import kill_process_tree

    load_plugins()
    server_args = prepare_server_args(plan.argv)
    _check_tail_replay_start(server_args)
    try:
        run_server(server_args)
    finally:
        kill_process_tree(os.getpid(), include_parent=False)
