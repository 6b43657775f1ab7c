"""The main job on a fresh machine: build a tiny hybrid, serve it patched, show prefix reuse.

`python -m sglang_ext demo [--arch qwen3-next] [--workdir runs/demo] [--server-args ...]`
prints, per request, prompt length, cached (reused) tokens, latency and whether the answer was
exact (and, when it was not, the bound of the state it started from: meta_info's `tail_replay`
block) for a multi-turn conversation over one long document, and for a second question that shares
only the document, once with SGLang's stock radix cache and once with Tail-Replay.
"""

from __future__ import annotations

import argparse
import time
from dataclasses import dataclass
from pathlib import Path

from eval.fixtures.tiny import build_tiny_model
from eval.harness import ServerProcess, servers_running

DOCUMENT_TOKENS = 2000
BACKENDS = {
    "stock SGLang radix cache": [],
    "Tail-Replay (5% budget)": ["--radix-cache-backend", "tail_replay", "--tail-replay-config", '{"budget": 0.05}'],
}


#: printed under the Tail-Replay table: what "exact" and the bound mean for a user
EXACTNESS_NOTE = ("exact: the answer is the one a server without cache gives (stock SGLang's answers always are); "
                  "otherwise the bound is the relative error bound of the linear-layer state the answer started "
                  "from (an approximate replay of a short tail of the cached prefix), which is what bought the "
                  "reused tokens. To get only exact answers, send `exactness: \"exact\"`.")


@dataclass(frozen=True)
class Turn:
    label: str
    prompt_tokens: int
    cached_tokens: int
    latency_s: float
    #: whether the answer equals a server without cache's
    exact: bool = True
    #: the bound of the state the answer started from, where Tail-Replay planned the request
    bound: float | None = None


def exactness(meta: dict) -> tuple[bool, float | None]:
    """(exact, bound) of an answer from its meta_info: Tail-Replay's summary
    (`cached_tokens_details.tail_replay`: `exact`, `bound`, and `kv_exact` where the server reports
    whether everything the request read was exact); a request without one (stock SGLang, or a
    request Tail-Replay did not plan) is exact."""
    details = meta.get("cached_tokens_details")
    summary = details.get("tail_replay") if isinstance(details, dict) else None
    if not isinstance(summary, dict):
        return True, None
    exact = bool(summary.get("exact", True)) and bool(summary.get("kv_exact", True))
    bound = summary.get("bound")
    return exact, None if bound is None else float(bound)


def _document(n_tokens: int) -> list[int]:
    return [(i * 37 + 11) % 480 + 10 for i in range(n_tokens)]


def _ask(server: ServerProcess, label: str, ids: list[int]) -> tuple[Turn, list[int]]:
    start = time.perf_counter()
    result = server.generate(input_ids=ids, sampling_params={"max_new_tokens": 8, "temperature": 0})
    latency = time.perf_counter() - start
    meta = result["meta_info"]
    exact, bound = exactness(meta)
    return Turn(label, meta["prompt_tokens"], meta["cached_tokens"], latency, exact, bound), result["output_ids"]


def run_conversation(server: ServerProcess) -> list[Turn]:
    doc = _document(DOCUMENT_TOKENS)
    turns = []
    first, answer = _ask(server, "turn 1: document + question A", doc + [101, 102, 103])
    turns.append(first)
    history = doc + [101, 102, 103] + answer
    second, _ = _ask(server, "turn 2: same conversation, next question", history + [104, 105])
    turns.append(second)
    third, _ = _ask(server, "new conversation: document + question B", doc + [201, 202, 203])
    turns.append(third)
    return turns


def _exact_cell(turn: Turn) -> str:
    if turn.exact:
        return "yes"
    return "no" if turn.bound is None else f"no (bound {turn.bound:.1e})"


def format_turns(turns: list[Turn]) -> str:
    rows = ["| request | prompt tokens | reused (cached) tokens | latency (s) | exact answer |",
            "|---|---:|---:|---:|---|"]
    rows += [f"| {t.label} | {t.prompt_tokens} | {t.cached_tokens} | {t.latency_s:.3f} | {_exact_cell(t)} |"
             for t in turns]
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m eval.demo")
    parser.add_argument("--arch", default="qwen3-next")
    parser.add_argument("--workdir", default="runs/demo")
    parser.add_argument("--server-args", default="", help="extra arguments for the server, one string")
    ns = parser.parse_args(argv)
    workdir = Path(ns.workdir)
    model_dir = build_tiny_model(ns.arch, workdir / f"tiny-{ns.arch}")
    print(f"built tiny {ns.arch} checkpoint in {model_dir}")
    servers = {name: ServerProcess(str(model_dir), ["--dtype", "float32", *args, *ns.server_args.split()],
                                   log_path=workdir / f"server-{i}.log")
               for i, (name, args) in enumerate(BACKENDS.items())}
    print(f"starting {len(servers)} patched SGLang servers (logs in {workdir}) ...")
    with servers_running(list(servers.values())):
        for name, server in servers.items():
            print(f"\n### {name}\n\n{format_turns(run_conversation(server))}")
        print(f"\n{EXACTNESS_NOTE}")


if __name__ == "__main__":
    main()
