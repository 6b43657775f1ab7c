"""What SGLang's `sglang.srt.plugins` entry point runs in every SGLang process.

With the patched launcher the patches are already applied (this is then a no-op). Under a
plain `sglang serve` on a GPU it checks the SGLang version and applies the extension's own
seams ("gpu" mode); the CPU patch set is never applied from here, because SGLang loads
plugins after it has imported `sgl_kernel`.
"""

from __future__ import annotations

from sglang_ext.env import read_env


def register() -> None:
    from patches import apply_patches

    apply_patches(read_env().patch_mode or "gpu")
    register_cache_backends()


def register_cache_backends() -> None:
    """Make `--radix-cache-backend tail_replay` selectable (idempotent)."""
    from sglang.srt.mem_cache.registry import register_radix_cache_backend, registered_radix_cache_backends

    from sglang_ext.tail_replay.cache import BACKEND_NAME, tail_replay_cache_factory

    if BACKEND_NAME not in registered_radix_cache_backends():
        register_radix_cache_backend(BACKEND_NAME, tail_replay_cache_factory)
