"""Command line: `sglang-ext serve` (the patched SGLang server) and `sglang-ext cluster` (SGLang's
router in front of N patched workers, sglang_ext/cluster/).

Fixture checkpoints and the demo are evaluation tools, outside the product package:
`python -m eval.fixtures` and `python -m eval.demo`.
"""

from __future__ import annotations

import sys

from sglang_ext.launcher import LaunchError
from sglang_ext.patches.version import UnsupportedSGLangVersion


def _serve(args: list[str]) -> None:
    from sglang_ext.launcher import serve

    serve(args)


def _cluster(args: list[str]) -> None:
    from sglang_ext.cluster import run_cluster

    raise SystemExit(run_cluster(args))


COMMANDS = {"serve": _serve, "cluster": _cluster}


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] not in COMMANDS:
        print(f"usage: sglang-ext {{{','.join(COMMANDS)}}} ...", file=sys.stderr)
        raise SystemExit(2)
    try:
        COMMANDS[argv[0]](argv[1:])
    except (LaunchError, UnsupportedSGLangVersion) as exc:
        print(f"sglang-ext: error: {exc}", file=sys.stderr)
        raise SystemExit(2) from None
