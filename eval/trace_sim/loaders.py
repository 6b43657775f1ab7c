"""Loaders for the real traces: the committed sample in ``eval/traces`` (see its README) by
default, or a folder with the same layout given by ``--traces-root`` / ``SGLANG_EXT_TRACES``.

* Mooncake (``*.jsonl.gz``): global prefix-chained ids over 512-token blocks, no
  sessions, no token types.
* kv-cache-tester (``trace_*.json.gz``): one agentic coding conversation per file,
  64-token blocks with per-file ids. The first ``floor((tool_tokens+system_tokens)/64)``
  blocks of every stream are mapped onto one shared id space (``main`` for the
  conversation itself, ``subagent:<type>`` for sub-agents) so the tools + system prefix
  is shared across conversations as it is in reality. Conversations are placed on one
  timeline by a seeded Poisson process of starts.
"""

from __future__ import annotations

import gzip
import json
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from .trace import NO_BLOCK, BlockTable, Request, Trace

#: the committed sample (eval/traces/README.md: which files, source, licence)
SAMPLE_TRACE_ROOT = Path(__file__).resolve().parents[1] / "traces"
#: where the named traces are read from unless a command's --traces-root says otherwise: the
#: sample, or the folder in SGLANG_EXT_TRACES (the full sets, same layout); read once, here
TRACES_ENV = "SGLANG_EXT_TRACES"
DEFAULT_TRACE_ROOT = Path(os.environ.get(TRACES_ENV) or SAMPLE_TRACE_ROOT)
MOONCAKE_BLOCK_TOKENS = 512
KV_BLOCK_TOKENS = 64

INPUT_TYPE_MAP = {"text": "user", "tool_result": "tool_output", "tool_use": "tool_call",
                  "thinking": "reasoning"}
OUTPUT_TYPE_MAP = {"text": "response", "thinking": "reasoning", "tool_use": "tool_call"}
OUTPUT_ORDER = ("thinking", "text", "tool_use")


def load_mooncake(path: Path, limit: int | None = None) -> Trace:
    """Read a Mooncake jsonl.gz trace; ``limit`` keeps the first N records."""
    table, requests = BlockTable(), []
    for record in _iter_jsonl(path, limit):
        ids = record["hash_ids"]
        last = table.intern_path(ids, ["unknown"] * len(ids))
        requests.append(Request(time=record["timestamp"] / 1000.0, last_block=last,
                                prompt_tokens=int(record["input_length"])))
    return table.freeze(f"mooncake:{Path(path).name}", MOONCAKE_BLOCK_TOKENS, requests)


def _iter_jsonl(path: Path, limit: int | None):
    with gzip.open(path, "rt") as handle:
        for index, line in enumerate(handle):
            if limit is not None and index >= limit:
                return
            if line.strip():
                yield json.loads(line)


@dataclass(frozen=True)
class KvLoadOptions:
    """How conversations are laid on one timeline and what is cached."""

    arrival_gap_s: float = 60.0  # mean gap between conversation starts (Poisson)
    seed: int = 0
    cache_outputs: bool = True  # SGLang caches generated tokens at request finish
    limit_files: int | None = None
    skip_files: int = 0  # conversations (files, in name order) left out before the first one loaded


def kv_trace_files(root: Path) -> list[Path]:
    files = sorted(Path(root).glob("trace_*.json.gz"))
    if not files:
        raise FileNotFoundError(f"no trace_*.json.gz under {root}")
    return files


def load_kv_cache_tester(root: Path, options: KvLoadOptions = KvLoadOptions()) -> Trace:
    files = kv_trace_files(root)[options.skip_files:]
    files = files[: options.limit_files]
    rng = np.random.default_rng(options.seed)
    starts = np.cumsum(rng.exponential(options.arrival_gap_s, size=len(files)))
    table, requests = BlockTable(), []
    for session, (path, start) in enumerate(zip(files, starts)):
        conversation = _read_json_gz(path)
        requests.extend(_load_conversation(table, conversation, float(start), session, options))
    notes = (f"{len(files)} conversations, Poisson starts with mean gap "
             f"{options.arrival_gap_s:g} s (seed {options.seed}), "
             f"outputs cached: {options.cache_outputs}",)
    return table.freeze("kv-cache-tester", KV_BLOCK_TOKENS, requests, notes)


def _read_json_gz(path: Path) -> dict:
    with gzip.open(path, "rt") as handle:
        return json.load(handle)


def _load_conversation(table, conversation, start, session, options) -> list[Request]:
    local_map = _LocalIdMap()
    out = []
    for namespace, prefix_blocks, offset, stream in _split_streams(conversation):
        loader = _StreamLoader(table, local_map, (namespace, prefix_blocks), session)
        paths = [loader.add(req, prev) for prev, req in zip([None] + stream[:-1], stream)]
        out.extend(_stream_requests(stream, paths, start + offset, session, options))
    return out


def _split_streams(conversation):
    """Main conversation plus one stream per sub-agent: (namespace, prefix blocks, t0, reqs)."""
    main, streams = [], []
    for req in conversation["requests"]:
        if req.get("type") == "subagent":
            prefix = (req["tool_tokens"] + req["system_tokens"]) // KV_BLOCK_TOKENS
            namespace = f"subagent:{req.get('subagent_type', 'unknown')}"
            streams.append((namespace, prefix, float(req["t"]), list(req["requests"])))
        elif "hash_ids" in req:
            main.append(req)
    prefix = (conversation["tool_tokens"] + conversation["system_tokens"]) // KV_BLOCK_TOKENS
    return [("main", prefix, 0.0, main)] + streams


class _LocalIdMap:
    """Per-file local id -> global id, as a growable numpy array (ids are small ints)."""

    def __init__(self) -> None:
        self.table = np.full(1024, NO_BLOCK, dtype=np.int64)

    def lookup(self, local: np.ndarray) -> np.ndarray:
        if local.size and int(local.max()) >= self.table.size:
            grown = np.full(2 * int(local.max()) + 1, NO_BLOCK, dtype=np.int64)
            grown[: self.table.size] = self.table
            self.table = grown
        return self.table[local]

    def assign(self, local_id: int, global_id: int) -> None:
        self.table[local_id] = global_id


class _StreamLoader:
    """Interns one stream's requests; returns each request's global path as an array."""

    def __init__(self, table, local_map, shared_prefix, file_key):
        self.table, self.local_map, self.file_key = table, local_map, file_key
        self.namespace, self.prefix_blocks = shared_prefix
        self.prev_path: np.ndarray | None = None

    def add(self, req, prev) -> np.ndarray:
        local = np.asarray(req["hash_ids"], dtype=np.int64)
        path = self.local_map.lookup(local)
        new_positions = np.flatnonzero(path == NO_BLOCK)
        if new_positions.size:
            types = self._region_types(req, prev, len(local))
            for pos in new_positions.tolist():
                path[pos] = self._intern(int(local[pos]), pos, path, types)
        self.prev_path = path
        return path

    def _intern(self, local_id, pos, path, types) -> int:
        parent = int(path[pos - 1]) if pos else NO_BLOCK
        if pos < self.prefix_blocks:
            gid = self.table.intern((self.namespace, pos), parent, "system")
        else:
            gid = self.table.intern((self.file_key, local_id), parent, types[pos])
        self.local_map.assign(local_id, gid)
        return gid

    def _region_types(self, req, prev, n_blocks) -> list[str]:
        """Type per position: shared prefix = system, then the previous turn's output,
        then what this turn appended (split evenly over its declared input types)."""
        types = ["system"] * min(self.prefix_blocks, n_blocks)
        cursor = len(types)
        if prev is not None and self.prev_path is not None:
            cursor = max(cursor, min(len(self.prev_path), n_blocks))
            types += ["user"] * (cursor - len(types))
            out_blocks = _output_block_count(prev, len(self.prev_path))
            types += _spread(_output_labels(prev), min(out_blocks, n_blocks - cursor))
        rest = n_blocks - len(types)
        types += _spread(_input_labels(req), rest)
        return types


def _output_block_count(req, n_prompt_blocks: int) -> int:
    total_tokens = int(req.get("in", 0)) + int(req.get("out", 0))
    return max(0, total_tokens // KV_BLOCK_TOKENS - n_prompt_blocks)


def _output_labels(req) -> list[str]:
    present = set(req.get("output_types") or ["text"])
    labels = [OUTPUT_TYPE_MAP[t] for t in OUTPUT_ORDER if t in present]
    return labels or ["response"]


def _input_labels(req) -> list[str]:
    labels = [INPUT_TYPE_MAP.get(t, "user") for t in (req.get("input_types") or ["text"])]
    return labels or ["user"]


def _spread(labels: list[str], count: int) -> list[str]:
    """``count`` positions split into equal consecutive runs, one per label."""
    if count <= 0:
        return []
    return [labels[min(len(labels) - 1, i * len(labels) // count)] for i in range(count)]


def _stream_requests(stream, paths, t0, session, options) -> list[Request]:
    out = []
    for k, (req, path) in enumerate(zip(stream, paths)):
        next_path = paths[k + 1] if k + 1 < len(paths) else None
        out_last = _output_end(req, path, next_path) if options.cache_outputs else NO_BLOCK
        out.append(Request(time=t0 + float(req["t"]),
                           last_block=int(path[-1]) if len(path) else NO_BLOCK,
                           prompt_tokens=int(req["in"]), session=session,
                           output_last_block=out_last))
    return out


def _output_end(req, path, next_path) -> int:
    """Last block of prompt+output that SGLang would cache, known through the next turn."""
    if next_path is None or len(next_path) <= len(path) or len(path) == 0:
        return NO_BLOCK
    if not np.array_equal(next_path[: len(path)], path):
        return NO_BLOCK
    n_out = min(_output_block_count(req, len(path)), len(next_path) - len(path))
    return int(next_path[len(path) + n_out - 1]) if n_out > 0 else NO_BLOCK


def load_named_trace(name: str, root: Path, kv_options: KvLoadOptions = KvLoadOptions(),
                     limit: int | None = None) -> Trace:
    root = Path(root)
    if name == "kv-cache-tester":
        return load_kv_cache_tester(root / "kv-cache-tester", kv_options)
    if name == "mooncake-conversation":
        return load_mooncake(root / "mooncake" / "conversation_trace.jsonl.gz", limit)
    if name == "mooncake-synthetic":
        return load_mooncake(root / "mooncake" / "synthetic_trace.jsonl.gz", limit)
    raise ValueError(f"unknown trace {name!r}")


