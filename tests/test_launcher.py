"""Launcher decisions and start-up errors (no server needed)."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest

from patches.version import UnsupportedSGLangVersion, check_sglang_version
from sglang_ext import SUPPORTED_SGLANG_VERSION
from sglang_ext.launcher import CPU_DEFAULTS, LaunchError, plan_launch


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


def test_cli_reports_a_bad_flag_as_a_one_line_error():
    proc = subprocess.run([sys.executable, "-m", "sglang_ext", "serve", "--model-path", "m",
                           "--attention-backend", "flashinfer"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert "sglang-ext: error: --attention-backend flashinfer is GPU-only" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_wrong_sglang_version_is_refused_with_the_fix():
    with pytest.raises(UnsupportedSGLangVersion, match=rf"supports sglang=={SUPPORTED_SGLANG_VERSION} only.*0\.5\.22"):
        check_sglang_version("0.5.22")


def test_serve_on_a_wrong_sglang_version_exits_with_a_clear_error(monkeypatch, capsys):
    from patches import version
    from sglang_ext import cli, env

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
