"""Command line: `serve` (patched SGLang server), `tiny-model` (fixture checkpoint), `demo`."""

from __future__ import annotations

import argparse
import sys

from patches.version import UnsupportedSGLangVersion
from sglang_ext.launcher import LaunchError


def _tiny_model(args: list[str]) -> None:
    from sglang_ext.models.tiny import ARCH_LAYOUTS, _load_arch_modules, build_tiny_model

    _load_arch_modules()
    parser = argparse.ArgumentParser(prog="sglang-ext tiny-model")
    parser.add_argument("--arch", required=True, choices=sorted(ARCH_LAYOUTS))
    parser.add_argument("--layout", default=None, help="architecture layout (e.g. dense, moe)")
    parser.add_argument("--out", required=True)
    parser.add_argument("--seed", type=int, default=0)
    ns = parser.parse_args(args)
    print(build_tiny_model(ns.arch, ns.out, seed=ns.seed, layout=ns.layout))


def _serve(args: list[str]) -> None:
    from sglang_ext.launcher import serve

    serve(args)


def _demo(args: list[str]) -> None:
    from sglang_ext.demo import main as demo_main

    demo_main(args)


COMMANDS = {"serve": _serve, "tiny-model": _tiny_model, "demo": _demo}


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
