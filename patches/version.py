"""The SGLang version guard. Reads package metadata only: never imports SGLang."""

from __future__ import annotations

from importlib import metadata

from sglang_ext import SUPPORTED_SGLANG_VERSION
from sglang_ext.env import ALLOW_OTHER_SGLANG_VAR, read_env


class UnsupportedSGLangVersion(RuntimeError):
    pass


def installed_sglang_version() -> str | None:
    try:
        return metadata.version("sglang")
    except metadata.PackageNotFoundError:
        return None


def check_sglang_version(installed: str | None = None) -> None:
    """Raise UnsupportedSGLangVersion unless the installed SGLang is the supported one."""
    found = installed if installed is not None else installed_sglang_version()
    if found == SUPPORTED_SGLANG_VERSION or read_env().allow_other_sglang:
        return
    raise UnsupportedSGLangVersion(
        f"sglang_ext supports sglang=={SUPPORTED_SGLANG_VERSION} only, but "
        f"{'no sglang' if found is None else 'sglang ' + found} is installed. "
        f"Install it with: pip install sglang=={SUPPORTED_SGLANG_VERSION} "
        f"(or set {ALLOW_OTHER_SGLANG_VAR}=1 to try anyway; the patches may not fit)."
    )
