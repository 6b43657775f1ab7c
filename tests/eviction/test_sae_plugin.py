"""The SGLang plugin path (GPU servers launched by plain SGLang): `sae` is a CLI choice and a
factory in every server, the seams are applied only when a server selects it, and a bad config
stops the start-up with one line naming the key."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

from sglang_ext import env

ROOT = Path(__file__).resolve().parents[2]

PROBE = textwrap.dedent("""
    import os
    from types import SimpleNamespace
    from sglang_ext.patches import apply_cpu_patches, applied_patches
    apply_cpu_patches()          # stands in for a GPU machine's SGLang import
    from sglang_ext import plugin
    cpu_only = applied_patches()
    plugin.register()
    from sglang.srt.arg_groups.choices import RADIX_EVICTION_POLICY_CHOICES
    from sglang.srt.mem_cache.utils import get_eviction_strategy
    from sglang_ext.eviction.sglang_adapter import SAEStrategy
    assert "sae" in RADIX_EVICTION_POLICY_CHOICES
    assert isinstance(get_eviction_strategy("sae", {"cost_power": 1.0}), SAEStrategy)
    assert applied_patches() == cpu_only, "register() alone must not patch"
    plugin.before_resolve(SimpleNamespace(radix_cache_backend=None, radix_eviction_policy="lru"))
    assert applied_patches() == cpu_only
    try:
        plugin.before_resolve(SimpleNamespace(radix_cache_backend=None, radix_eviction_policy="sae",
                                              radix_eviction_policy_config={"cost_powr": 1}))
    except SystemExit as exc:
        print("exit:", exc)
    try:
        plugin.before_resolve(SimpleNamespace(radix_cache_backend=None, radix_eviction_policy="sae",
                                              radix_eviction_policy_config={"max_sessions": 0}))
    except SystemExit as exc:
        print("exit:", exc)
    assert applied_patches() == cpu_only
    plugin.before_resolve(SimpleNamespace(radix_cache_backend=None, radix_eviction_policy="sae",
                                          radix_eviction_policy_config={"cost_power": 1}))
    assert {"sae.policy", "sae.full_eviction", "sae.cache_events"} <= set(applied_patches())
    assert os.environ["SGLANG_EXT_PATCH_MODE"] == "gpu"
    print("sae-plugin-probe-ok")
""")


def test_plugin_registers_sae_and_patches_only_servers_that_select_it():
    environ = {k: v for k, v in os.environ.items() if k != env.PATCH_MODE_VAR}
    proc = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, timeout=300,
                          cwd=ROOT, env={**environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "sae-plugin-probe-ok" in proc.stdout
    assert ("exit: sglang_ext: error: --radix-eviction-policy-config key 'cost_powr' is not a setting of 'sae'"
            in proc.stdout)
    assert ("exit: sglang_ext: error: --radix-eviction-policy-config key 'max_sessions' must be an integer >= 1, "
            "got 0" in proc.stdout)
