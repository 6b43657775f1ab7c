"""The module every spawned SGLang child imports before it unpickles its target.

multiprocessing's spawn re-imports the parent's main module in each child, but skips
packages' `__main__` modules; `use_as_spawn_main()` (called by the launcher) names this
module instead, so children apply the runtime patches before they import SGLang.
"""

from __future__ import annotations

import multiprocessing.spawn

from sglang_ext.env import read_env


def apply_from_env() -> list[str]:
    """Apply the patch set named by the environment (set by the launcher), if any."""
    mode = read_env().patch_mode
    if mode is None:
        return []
    from sglang_ext.patches import apply_patches

    return apply_patches(mode)


apply_from_env()


def use_as_spawn_main() -> None:
    """Make spawned children import this module as their `__mp_main__`."""
    original = multiprocessing.spawn.get_preparation_data
    if getattr(original, "_sglang_ext_patched", False):
        return

    def get_preparation_data(name):
        data = original(name)
        data.pop("init_main_from_path", None)
        data["init_main_from_name"] = __name__
        return data

    get_preparation_data._sglang_ext_patched = True
    multiprocessing.spawn.get_preparation_data = get_preparation_data
