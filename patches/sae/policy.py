"""`--radix-eviction-policy sae`: SAECache as a radix eviction policy.

Targets (SGLang 0.5.23): `srt/mem_cache/utils.py: _EVICTION_POLICY_FACTORIES` (the factory
`get_eviction_strategy` builds from `--radix-eviction-policy-config` as keyword arguments),
`srt/arg_groups/choices.py: add_radix_eviction_policy_choices` (the CLI choice) and
`srt/arg_groups/kv_cache_hook.py: handle_cache_compatibility` (the main process's start-up
check of the cache flags, where SGLang checks tlru's config): a bad key or value of the
`sae` config stops the launch there with a ValueError naming the key, before any
scheduler starts (SystemExit with one line `sglang_ext: error: ...`). Servers choosing another policy are untouched.
"""

from __future__ import annotations

import functools

TARGET = ("srt/mem_cache/utils.py: _EVICTION_POLICY_FACTORIES; srt/arg_groups/choices.py: "
          "add_radix_eviction_policy_choices; srt/arg_groups/kv_cache_hook.py: handle_cache_compatibility")


def _wrap_check(original):
    @functools.wraps(original)
    def handle_cache_compatibility(server_args, *args, **kwargs):
        from sglang_ext.eviction.sglang_adapter import check_server_args

        try:
            check_server_args(server_args)
        except ValueError as exc:   # one clear line, no traceback (as the plugin's start-up errors)
            raise SystemExit(f"sglang_ext: error: {exc}") from None
        return original(server_args, *args, **kwargs)

    return handle_cache_compatibility


def apply() -> None:
    from sglang.srt.arg_groups import kv_cache_hook

    from sglang_ext.eviction.sglang_adapter import register_policy

    register_policy()
    kv_cache_hook.handle_cache_compatibility = _wrap_check(kv_cache_hook.handle_cache_compatibility)
