"""Launcher decisions and start-up errors (no server needed)."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

from sglang_ext import SUPPORTED_SGLANG_VERSION
from sglang_ext.env import CPU_THREADS_VAR
from sglang_ext.launcher import CPU_DEFAULTS, LaunchError, cpu_thread_env, plan_launch
from sglang_ext.patches.version import UnsupportedSGLangVersion, check_sglang_version


def test_cpu_plan_fills_defaults_without_overriding_user_flags():
    plan = plan_launch(["--model-path", "m", "--max-total-tokens", "999"], gpu_available=False)
    assert plan.mode == "cpu"
    assert plan.argv.count("--max-total-tokens") == 1 and "999" in plan.argv
    assert plan.argv[plan.argv.index("--device") + 1] == "cpu"
    assert all(flag in plan.argv for flag in CPU_DEFAULTS)


def test_gpu_plan_passes_arguments_through_untouched():
    argv = ["--model-path", "m", "--attention-backend", "flashinfer"]
    plan = plan_launch(argv, gpu_available=True)
    assert plan == plan.__class__("gpu", argv)


def test_explicit_cpu_device_on_a_gpu_machine_uses_the_cpu_patches():
    assert plan_launch(["--model-path", "m", "--device", "cpu"], gpu_available=True).mode == "cpu"


@pytest.mark.parametrize("argv, needle", [
    (["--model-path", "m", "--attention-backend", "flashinfer"], "--attention-backend flashinfer is GPU-only"),
    (["--model-path", "m", "--attention-backend=fa3"], "--attention-backend fa3 is GPU-only"),
    (["--model-path", "m", "--device", "cuda"], "--device cuda"),
    (["--port", "1"], "--model-path is required"),
])
def test_gpu_only_flags_on_cpu_are_refused_by_name(argv, needle):
    with pytest.raises(LaunchError, match=needle):
        plan_launch(argv, gpu_available=False)


def _value(argv: list[str], flag: str) -> str:
    assert argv.count(flag) == 1, argv
    return argv[argv.index(flag) + 1]


@pytest.mark.parametrize("switch", ["--enable-hierarchical-cache", "--enable-hicache"])
def test_cpu_hicache_gets_the_direct_io_backend_and_page_first_direct_layout(switch):
    argv = plan_launch(["--model-path", "m", switch], gpu_available=False).argv
    assert _value(argv, "--hicache-io-backend") == "direct"
    assert _value(argv, "--hicache-mem-layout") == "page_first_direct"
    assert plan_launch(["--model-path", "m"], gpu_available=False).argv.count("--hicache-io-backend") == 0
    gpu_argv = ["--model-path", "m", switch]                  # GPUs keep SGLang's own defaults
    assert plan_launch(gpu_argv, gpu_available=True).argv == gpu_argv


@pytest.mark.parametrize("given, layout", [(["--hicache-mem-layout", "layer_first"], "layer_first"),
                                           (["--hicache-mem-layout=page_first"], "page_first"),
                                           (["--hicache-io-backend", "direct"], "page_first_direct")])
def test_cpu_hicache_keeps_what_the_user_set(given, layout):
    argv = plan_launch(["--model-path", "m", "--enable-hierarchical-cache", *given], gpu_available=False).argv
    assert sum(a.startswith("--hicache-mem-layout") for a in argv) == 1
    assert sum(a.startswith("--hicache-io-backend") for a in argv) == 1
    assert (layout in argv) or (f"--hicache-mem-layout={layout}" in argv)


@pytest.mark.parametrize("given, needle", [
    (["--hicache-io-backend", "kernel"], "--hicache-io-backend kernel does not run on CPU"),
    (["--hicache-io-backend=kernel_ascend"], "--hicache-io-backend kernel_ascend does not run on CPU"),
    (["--hicache-mem-layout", "page_head"], "--hicache-mem-layout page_head does not run on CPU"),
    (["--hicache-mem-layout", "page_first_kv_split"], "--hicache-mem-layout page_first_kv_split"),
])
def test_cpu_hicache_refuses_gpu_only_transfer_settings_by_name(given, needle):
    with pytest.raises(LaunchError, match=re.escape(needle)):
        plan_launch(["--model-path", "m", "--enable-hicache", *given], gpu_available=False)
    plan_launch(["--model-path", "m", *given], gpu_available=False)    # inert without HiCache


def test_cli_reports_a_bad_flag_as_a_one_line_error():
    proc = subprocess.run([sys.executable, "-m", "sglang_ext", "serve", "--model-path", "m",
                           "--attention-backend", "flashinfer"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert "sglang-ext: error: --attention-backend flashinfer is GPU-only" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_cpu_thread_defaults_use_every_core_and_wait_passively():
    env = cpu_thread_env({}, cpu_count=2)
    assert env == {"OMP_NUM_THREADS": "2", "MKL_NUM_THREADS": "2", "OMP_WAIT_POLICY": "PASSIVE",
                   "GOMP_SPINCOUNT": "0", "KMP_BLOCKTIME": "0"}
    assert cpu_thread_env({}, cpu_count=16)["OMP_NUM_THREADS"] == "16"
    assert cpu_thread_env({}, cpu_count=1)["OMP_NUM_THREADS"] == "1"


def test_cpu_thread_defaults_never_override_what_the_user_set():
    user = {"OMP_NUM_THREADS": "2", "OMP_WAIT_POLICY": "ACTIVE"}
    env = cpu_thread_env(user, cpu_count=8)
    assert "OMP_NUM_THREADS" not in env and "OMP_WAIT_POLICY" not in env
    # torch's thread count follows MKL_NUM_THREADS over OMP_NUM_THREADS: it must agree with the user's
    assert env["MKL_NUM_THREADS"] == "2" and env["GOMP_SPINCOUNT"] == "0"
    assert cpu_thread_env({"MKL_NUM_THREADS": "3"}, cpu_count=8)["OMP_NUM_THREADS"] == "3"


def test_torch_follows_the_thread_count_the_launcher_exports():
    """The exported variables give torch's intra-op pool the intended size in a fresh process
    (what SGLang's spawned scheduler is), also when the user set only OMP_NUM_THREADS."""
    base = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", CPU_THREADS_VAR)}
    for user, want in (({"OMP_NUM_THREADS": "1"}, 1), ({CPU_THREADS_VAR: "2"}, 2)):
        env = {**base, **user}
        env.update(cpu_thread_env(env, cpu_count=2))
        out = subprocess.run([sys.executable, "-c", "import torch; print(torch.get_num_threads())"],
                             env=env, capture_output=True, text=True, timeout=120)
        assert out.stdout.strip() == str(want), (user, out.stderr[-500:])


@pytest.mark.parametrize("value, threads", [("auto", "4"), ("", "4"), ("2", "2"), (" 6 ", "6")])
def test_cpu_thread_count_override(value, threads):
    env = cpu_thread_env({CPU_THREADS_VAR: value}, cpu_count=4)
    assert env["OMP_NUM_THREADS"] == env["MKL_NUM_THREADS"] == threads
    assert env["OMP_WAIT_POLICY"] == "PASSIVE"


def test_cpu_threads_keep_exports_nothing():
    assert cpu_thread_env({CPU_THREADS_VAR: "keep"}, cpu_count=4) == {}


@pytest.mark.parametrize("value", ["0", "-1", "many", "1.5"])
def test_bad_cpu_thread_setting_is_refused_by_name(value):
    with pytest.raises(LaunchError, match=rf"{CPU_THREADS_VAR}='{value}'"):
        cpu_thread_env({CPU_THREADS_VAR: value}, cpu_count=4)


def test_serve_exports_cpu_thread_defaults_to_the_server_processes(monkeypatch):
    """serve() on CPU puts the chosen thread settings into the environment its children inherit."""
    from sglang_ext import cli, env
    from sglang_ext.patches import version

    for var in (env.PATCH_MODE_VAR, env.SGLANG_CPU_ENGINE_VAR, "OMP_WAIT_POLICY", "GOMP_SPINCOUNT",
                "KMP_BLOCKTIME", "MKL_NUM_THREADS", CPU_THREADS_VAR):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("OMP_NUM_THREADS", "1")       # the user's choice stays
    monkeypatch.setattr(version, "installed_sglang_version", lambda: "0.5.22")   # stop before SGLang
    with pytest.raises(SystemExit):
        cli.main(["serve", "--model-path", "m", "--device", "cpu"])
    assert os.environ["OMP_NUM_THREADS"] == "1"
    assert os.environ["OMP_WAIT_POLICY"] == "PASSIVE" and os.environ["GOMP_SPINCOUNT"] == "0"


def test_wrong_sglang_version_is_refused_with_the_fix():
    with pytest.raises(UnsupportedSGLangVersion, match=rf"supports sglang=={SUPPORTED_SGLANG_VERSION} only.*0\.5\.22"):
        check_sglang_version("0.5.22")


def test_serve_on_a_wrong_sglang_version_exits_with_a_clear_error(monkeypatch, capsys):
    from sglang_ext import cli, env
    from sglang_ext.patches import version

    for var in (env.PATCH_MODE_VAR, env.SGLANG_CPU_ENGINE_VAR):   # serve() exports these
        monkeypatch.setenv(var, "")
    monkeypatch.setattr(version, "installed_sglang_version", lambda: "0.5.22")
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["serve", "--model-path", "m", "--device", "cpu"])
    assert exit_info.value.code == 2
    assert "sglang-ext: error: sglang_ext supports sglang==0.5.23 only, but sglang 0.5.22" in capsys.readouterr().err


def test_supported_version_passes():
    check_sglang_version(SUPPORTED_SGLANG_VERSION)


@pytest.mark.parametrize("config, kv_dtype, needle", [
    ('{"bugdet": 0.1}', "auto", "'bugdet': unknown key"),                       # from the env, not the flag
    ('{"budget": 0.1}', "fp8_e4m3", "--kv-cache-dtype fp8_e4m3 (a quantized KV cache) cannot run"),
])
def test_tail_replay_start_is_checked_in_the_main_process(monkeypatch, config, kv_dtype, needle):
    from types import SimpleNamespace

    from sglang_ext import env
    from sglang_ext.launcher import _check_tail_replay_start

    monkeypatch.setenv(env.TAIL_REPLAY_CONFIG_VAR, config)
    with pytest.raises(LaunchError, match=re.escape(needle)):
        _check_tail_replay_start(SimpleNamespace(radix_cache_backend="tail_replay", kv_cache_dtype=kv_dtype))
    _check_tail_replay_start(SimpleNamespace(radix_cache_backend=None, kv_cache_dtype=kv_dtype))  # not ours


def test_bad_start_method_is_refused_by_name(monkeypatch, capsys):
    from sglang_ext import cli, env

    for var in (env.PATCH_MODE_VAR, env.SGLANG_CPU_ENGINE_VAR):   # serve() exports these
        monkeypatch.setenv(var, "")
    monkeypatch.setenv(env.CPU_START_METHOD_VAR, "forkserver")
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["serve", "--model-path", "m", "--device", "cpu"])
    assert exit_info.value.code == 2
    assert "SGLANG_EXT_CPU_START_METHOD='forkserver': expected one of spawn, fork" in capsys.readouterr().err


@pytest.mark.parametrize("mode, method, refused", [("cpu", "fork", False), ("cpu", "spawn", False),
                                                   ("gpu", "spawn", False), ("gpu", "fork", True)])
def test_fork_is_for_the_cpu_server_only(monkeypatch, mode, method, refused):
    from sglang_ext import env, launcher

    monkeypatch.setenv(env.CPU_START_METHOD_VAR, method)
    if refused:
        with pytest.raises(LaunchError, match="SGLANG_EXT_CPU_START_METHOD=fork is for the CPU server only"):
            launcher._check_start_method(mode)
    else:
        launcher._check_start_method(mode)
