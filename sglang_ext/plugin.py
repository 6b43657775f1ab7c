"""What SGLang's `sglang.srt.plugins` entry point runs in every SGLang process.

SGLang calls `register()` early in each process (main, schedulers, detokenizer), before the
main process has parsed its arguments. It patches only servers that select
`--radix-cache-backend tail_replay`:

- With `SGLANG_EXT_PATCH_MODE` set (by the patched launcher, or by the main process below for
  its children) the patches of that mode are applied (a no-op where the launcher already did)
  and the backend is registered.
- Otherwise (the main process of a plain `sglang serve` / `python -m sglang.launch_server` /
  `sglang.Engine`, and every process of a server that does not use Tail-Replay) it only hooks
  `ServerArgs.resolve_once`, which every launch path runs in the main process before any child
  starts. When the arguments select `tail_replay`, the hook validates the config
  (`SGLANG_EXT_TAIL_REPLAY_CONFIG`) and its combination with the server flags once, exiting
  with one clear line on an error; then applies the extension's own seams ("gpu" mode) in
  this process and exports the mode, so the children apply them too. Any other server is left
  untouched.

The CPU patch set is never applied from here, because SGLang loads plugins after it has
imported `sgl_kernel`.
"""

from __future__ import annotations

from typing import Any

from sglang_ext.env import export_patch_mode, read_env

#: the SGLang method hooked in the main process (its first argument is the ServerArgs)
RESOLVE_TARGET = "sglang.srt.server_args.ServerArgs.resolve_once"


def register() -> None:
    mode = read_env().patch_mode
    if mode is not None:
        _apply(mode)
        return
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    HookRegistry.register(RESOLVE_TARGET, before_resolve, HookType.BEFORE)
    from sglang_ext.eviction.sglang_adapter import register_policy

    register_policy()   # `--radix-eviction-policy sae` parses; the seams come below when chosen


def before_resolve(server_args: Any, *args: Any, **kwargs: Any) -> None:
    """BEFORE hook on `ServerArgs.resolve_once` (main process, plain-SGLang launch)."""
    if read_env().patch_mode is None and (selects_tail_replay(server_args) or selects_sae(server_args)):
        try:
            if selects_tail_replay(server_args):
                check_main_process(server_args)
            if selects_sae(server_args):
                from sglang_ext.eviction.sglang_adapter import check_server_args

                check_server_args(server_args)
        except ValueError as exc:
            raise SystemExit(f"sglang_ext: error: {exc}") from None
        export_patch_mode("gpu")   # inherited by every child SGLang starts from here on
        _apply("gpu")
    return None


def selects_tail_replay(server_args: Any) -> bool:
    """Tail-Replay's backend, or LinearKV's (which serves the exact prefix with Tail-Replay)."""
    from sglang_ext.linearkv import BACKEND_NAME as LINEARKV
    from sglang_ext.tail_replay import BACKEND_NAME

    return getattr(server_args, "radix_cache_backend", None) in (BACKEND_NAME, LINEARKV)


def selects_sae(server_args: Any) -> bool:
    from sglang_ext.eviction.sglang_adapter import POLICY_NAME

    return getattr(server_args, "radix_eviction_policy", None) == POLICY_NAME


def check_main_process(server_args: Any) -> list[str]:
    """Parse the server's Tail-Replay config and check it against the flags; raise ValueError
    (TailReplayConfigError / StartupError) naming the key or both flags; return the summary.
    A local model folder's decay.json becomes the config's `decay_profile` (for budget "auto").
    Where the combination admits it, the server runs on one byte budget: `--enable-unified-memory`
    is turned on here, before SGLang resolves the flags (`apply_unified_memory_default`). May
    mutate: `server_args.enable_unified_memory`."""
    from sglang_ext.env import export_tail_replay_config, linearkv_config_text, tail_replay_config_text
    from sglang_ext.linearkv import check_server_flags
    from sglang_ext.linearkv import parse_server_config as parse_config
    from sglang_ext.tail_replay import (
        apply_unified_memory_default,
        check_start,
        facts_from_server_args,
        server_config,
        with_model_profile,
    )

    check_server_flags(server_args)
    parse_config(linearkv_config_text())
    facts = facts_from_server_args(server_args)
    text = tail_replay_config_text()
    resolved = with_model_profile(text, facts.model_path)
    if resolved != text and resolved is not None:
        export_tail_replay_config(resolved)   # every process SGLang starts from here on sees it
    lines = check_start(server_config(), facts)
    return [*lines, apply_unified_memory_default(server_args, server_config())]


def _apply(mode: str) -> None:
    from sglang_ext.patches import apply_patches

    apply_patches(mode)
    register_cache_backends()


def register_cache_backends() -> None:
    """Make `--radix-cache-backend tail_replay` and `linearkv` selectable, and wire the wings'
    extension points (`sglang_ext.hooks`: LinearKV's additions to Tail-Replay's seams); idempotent."""
    from sglang.srt.mem_cache.registry import register_radix_cache_backend, registered_radix_cache_backends

    from sglang_ext.linearkv import BACKEND_NAME as LINEARKV
    from sglang_ext.linearkv import register_hooks as register_linearkv_hooks
    from sglang_ext.tail_replay import BACKEND_NAME, tail_replay_cache_factory

    register_linearkv_hooks()

    if BACKEND_NAME not in registered_radix_cache_backends():
        register_radix_cache_backend(BACKEND_NAME, tail_replay_cache_factory)
    if LINEARKV not in registered_radix_cache_backends():
        from sglang_ext.linearkv import linearkv_cache_factory

        register_radix_cache_backend(LINEARKV, linearkv_cache_factory)
