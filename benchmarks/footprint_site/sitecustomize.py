"""Loaded by every Python process of a server that `benchmarks/hit_footprint.py` starts (it puts
this folder first on PYTHONPATH): records which of the extension's modules run code, per phase.

A profile hook (`sys.setprofile`, every thread) notes the file (and name) of each Python function
called. A
watcher thread reads `$SGLANG_EXT_FOOTPRINT_DIR/phase` every 20 ms; when its content changes, the
process writes the files noted since the last change to `<dir>/<pid>-<old phase>.json` and starts
afresh. Only files of the extension (`sglang_ext/`, `patches/`) are kept.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time

_DIR = os.environ.get("SGLANG_EXT_FOOTPRINT_DIR")


def _ours(path: str) -> str | None:
    """The module's path inside the extension (`sglang_ext/...` or `patches/...`), or None."""
    for marker in ("/sglang_ext/patches/", "/patches/"):
        if marker in path:
            return "patches/" + path.split(marker, 1)[1]
    if "/sglang_ext/" in path:
        return "sglang_ext/" + path.split("/sglang_ext/", 1)[1]
    return None


if _DIR:
    _seen: set[str] = set()
    _functions: set[str] = set()
    _memo: dict[str, str | None] = {}

    def _profile(frame, event, arg):
        if event == "call":
            path = frame.f_code.co_filename
            name = _memo.get(path, "")
            if name == "":
                name = _memo[path] = _ours(path)
            if name is not None:
                _seen.add(name)
                _functions.add(f"{name}:{frame.f_code.co_name}")

    def _watch() -> None:
        control = os.path.join(_DIR, "phase")
        phase = None
        while True:
            try:
                with open(control) as f:
                    now = f.read().strip()
            except OSError:
                now = None
            if now != phase:
                if phase is not None:
                    noted, functions = sorted(_seen), sorted(_functions)
                    _seen.clear()
                    _functions.clear()
                    with open(os.path.join(_DIR, f"{os.getpid()}-{phase}.json"), "w") as f:
                        json.dump({"pid": os.getpid(), "argv": sys.argv[:3], "modules": noted,
                                   "functions": functions}, f)
                else:
                    _seen.clear()
                    _functions.clear()
                phase = now
            time.sleep(0.02)

    def _start() -> None:
        sys.setprofile(_profile)
        threading.setprofile(_profile)
        threading.Thread(target=_watch, name="footprint-watch", daemon=True).start()

    _start()
    os.register_at_fork(after_in_child=_start)
