"""What a replay replays: the trace (a named trace under `--traces-root` or a file / folder in
its format, scaled to synthetic tokens) and the model (the tiny fixture or `--model`), with bad
input refused by name (`ReplayError`)."""

from __future__ import annotations

import json
from pathlib import Path

from eval.replay.tokens import TOKEN_HI, ScaledRequest, scale_trace
from eval.trace_sim.loaders import KvLoadOptions, load_kv_cache_tester, load_mooncake

TRACE_NAMES = {
    "mooncake-conversation": ("mooncake", "mooncake/conversation_trace.jsonl.gz"),
    "mooncake-synthetic": ("mooncake", "mooncake/synthetic_trace.jsonl.gz"),
    "kv-cache-tester": ("kv-cache-tester", "kv-cache-tester"),
    "sharegpt-chat": ("kv-cache-tester", "sharegpt-chat"),   # eval/replay/sharegpt.py, same format
}


class ReplayError(ValueError):
    """Bad replay input (trace, model, option); the message names it."""


def load_trace(args) -> tuple[dict, list[ScaledRequest]]:
    """(trace description, scaled requests) for the options."""
    kind, path = resolve_trace(args.trace, args.traces_root)
    tokens_per_block = args.tokens_per_block or (16 if kind == "mooncake" else 1)
    if kind == "mooncake":
        trace = load_mooncake(path, limit=args.requests)
        sessions_loaded = None
    else:
        trace = load_kv_cache_tester(path, KvLoadOptions(arrival_gap_s=args.session_gap_s,
                                                         limit_files=args.sessions, skip_files=args.skip_sessions))
        available = len(list(path.glob("trace_*.json.gz"))) - args.skip_sessions
        if available < 1:
            raise ReplayError(f"--skip-sessions {args.skip_sessions}: {path} has no conversation after those")
        sessions_loaded = min(args.sessions, available)
    scaled = scale_trace(trace, tokens_per_block, args.requests, seed=args.seed)
    if not scaled:
        raise ReplayError(f"--trace {args.trace}: no request with at least one block")
    info = {"name": trace.name, "path": str(path), "format": kind, "block_tokens": trace.block_tokens,
            "tokens_per_block": tokens_per_block, "requests": len(scaled),
            "sessions_loaded": sessions_loaded,
            "sessions_in_replay": len({r.session for r in scaled}) if kind != "mooncake" else None,
            "prompt_tokens": sum(len(r.tokens) for r in scaled),
            "max_prompt_tokens": max(len(r.tokens) for r in scaled), "notes": list(trace.notes)}
    return info, scaled


def resolve_trace(name: str, root: Path) -> tuple[str, Path]:
    if name in TRACE_NAMES:
        kind, rel = TRACE_NAMES[name]
        path = Path(root) / rel
        if not path.exists():
            raise ReplayError(f"--trace {name}: {path} does not exist (set --traces-root)")
        return kind, path
    path = Path(name)
    if path.is_dir():
        return "kv-cache-tester", path
    if path.is_file() and (path.name.endswith(".jsonl.gz") or path.name.endswith(".jsonl")):
        return "mooncake", path
    raise ReplayError(f"--trace {name!r}: not a known trace ({', '.join(TRACE_NAMES)}), a Mooncake "
                      ".jsonl(.gz) file or a kv-cache-tester directory")


def resolve_model(args) -> Path:
    if args.model is None:
        from eval.fixtures.tiny import build_tiny_model

        model = args.out / "model-qwen3-next"
        if not (model / "config.json").exists():
            build_tiny_model("qwen3-next", model, seed=0)
    else:
        model = Path(args.model)
    config = model / "config.json"
    if not config.exists():
        raise ReplayError(f"--model {model}: no config.json there")
    vocab = json.loads(config.read_text()).get("vocab_size")
    if vocab is not None and vocab < TOKEN_HI:
        raise ReplayError(f"--model {model}: vocab_size {vocab} < {TOKEN_HI}, the synthetic ids' range")
    return model
