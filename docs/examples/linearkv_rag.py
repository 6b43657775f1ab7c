"""RAG over a shared passage pool with SGLang's frontend language, served by LinearKV.

Each program retrieves a few passages from one shared pool and writes
`system + sep + passage + sep + ... + sep + question`; a server started with a server-wide
separator (`--linearkv-config '{"separator": " # # "}'`) cuts the prompt there, registers every
passage as a chunk the first time it sees it, and from then on serves it from the chunk cache at
whatever offset and in whatever order it appears (its KV re-rotated; the question's linear state
from the last passage's cached end state). The separators never reach the model.

    # a linearkv server (CPU: a tiny fixture; any GDN / Mamba-2 hybrid on a GPU)
    python -m eval.fixtures --arch qwen3-next --out runs/tiny-qwen3-next
    python -m sglang_ext serve --model-path runs/tiny-qwen3-next --dtype float32 --port 30000 \\
        --radix-cache-backend linearkv --linearkv-config '{"separator": " # # "}'
    # the programs
    python docs/examples/linearkv_rag.py --url http://127.0.0.1:30000

The script runs the whole batch of questions twice with `run_batch` (the second time each
question's passages come re-ranked, in another order) and prints, per program, the answer and
`meta_info.cached_tokens_details.linearkv` of its `gen` call. A passage is registered by the first
request that brings it (a prefill of the passage alone, inside that request) and reused by every
later one; the system prompt P comes from the ordinary radix tree (`run_batch` sends the traced
common prefix ahead, which puts it there; a request whose P is not cached yet is prefilled in full,
`chunks_missed`).
"""

from __future__ import annotations

import argparse
import re
from dataclasses import dataclass

import sglang as sgl

SEPARATOR = " # # "
SYSTEM = "You answer questions using only the passages below. Keep answers short."

#: the shared passage pool (a real application would hold thousands and retrieve with an index)
PASSAGES = (
    "The Orrin Canal was dug between 1821 and 1834 to carry coal from the hill mines to the port of "
    "Velmouth. Its forty-two locks lift boats a total of ninety metres, and horses towed the barges "
    "until steam tugs replaced them in 1880.",
    "Velmouth is a harbour town on the western coast. Its lighthouse, built of grey granite in 1812, "
    "stands on a rock called the Anvil and its lamp can be seen from thirty kilometres out to sea.",
    "The hill mines above the Orrin valley produced anthracite for almost two centuries. The last pit, "
    "Carreg Deep, closed in 1968, and its winding house is now a museum of mining tools and lamps.",
    "Brenna Hale was the engineer who designed the Orrin Canal's tallest flight of locks, a staircase "
    "of seven chambers near the village of Pentre. She later built iron bridges along the coast road.",
    "The village of Pentre grew around the lock staircase. Its market, held every Thursday since 1840, "
    "sells wool, cheese and slate, and its chapel has a carved oak ceiling painted blue and gold.",
    "Steam tugs on the canal were built at the Velmouth yard. The first, named Kestrel, could pull "
    "twelve loaded barges at once; it was scrapped in 1921 after the railway took most of the coal.",
    "The coast road runs north from Velmouth for sixty kilometres. Brenna Hale's iron bridges carry it "
    "over three river mouths, the longest spanning one hundred and ten metres across the Dyfan estuary.",
    "The canal closed to commercial traffic in 1952. Volunteers restored the towpath in the 1990s, and "
    "today walkers and cyclists follow it from the port to the old mines in a long day.",
)

QUESTIONS = (
    "Who designed the tallest flight of locks on the canal?",
    "What did the Orrin Canal carry, and to where?",
    "When did the last mine close, and what is its winding house now?",
    "What was the first steam tug called?",
    "How long is the longest iron bridge on the coast road?",
    "What is sold at the Pentre market?",
    "When did the canal close to commercial traffic?",
    "What is the lighthouse at Velmouth built of?",
)


def _words(text: str) -> set[str]:
    return set(re.findall(r"[a-z]+", text.lower())) - {"the", "a", "of", "and", "to", "what", "is", "on", "was", "did"}


def retrieve(question: str, k: int = 3, pool: tuple[str, ...] = PASSAGES) -> list[str]:
    """The k passages sharing the most words with the question, best first (a toy retriever)."""
    q = _words(question)
    ranked = sorted(range(len(pool)), key=lambda i: (-len(q & _words(pool[i])), i))
    return [pool[i] for i in ranked[:k]]


@sgl.function
def rag(s, passages, question, separator=SEPARATOR, max_tokens=16):
    s += SYSTEM + separator
    for passage in passages:
        s += passage + separator
    s += "Question: " + question + "\nAnswer:"
    s += sgl.gen("answer", max_tokens=max_tokens, temperature=0)


@dataclass(frozen=True)
class ProgramResult:
    round: int
    question: str
    passages: tuple[str, ...]
    answer: str
    linearkv: dict     # meta_info.cached_tokens_details.linearkv of the gen call ({} if absent)


def run(url: str, rounds: int = 2, k: int = 3, num_threads: int = 4, max_tokens: int = 16,
        separator: str = SEPARATOR) -> list[ProgramResult]:
    """Every question once per round with `run_batch`; in round r each question's passages are
    rotated by r (a re-ranking: the same passages in another order)."""
    backend = sgl.RuntimeEndpoint(url)
    results = []
    for r in range(rounds):
        batch = []
        for q in QUESTIONS:
            passages = retrieve(q, k)
            passages = passages[r % k:] + passages[:r % k]
            batch.append({"passages": passages, "question": q, "separator": separator, "max_tokens": max_tokens})
        states = rag.run_batch(batch, backend=backend, num_threads=num_threads)
        for args, state in zip(batch, states):
            meta = state.get_meta_info("answer") or {}
            details = meta.get("cached_tokens_details") or {}
            results.append(ProgramResult(r, args["question"], tuple(args["passages"]), state["answer"],
                                         dict(details.get("linearkv") or {})))
    return results


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--url", required=True, help="a server run with --radix-cache-backend linearkv")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--k", type=int, default=3, help="passages per question")
    ap.add_argument("--threads", type=int, default=4, help="run_batch's num_threads")
    ap.add_argument("--separator", default=SEPARATOR, help="the server's linearkv separator")
    args = ap.parse_args(argv)
    results = run(args.url, rounds=args.rounds, k=args.k, num_threads=args.threads, separator=args.separator)
    for res in results:
        lkv = res.linearkv
        print(f"[round {res.round}] {res.question}\n    answer: {res.answer.strip()!r}\n    linearkv: {lkv or '-'}")
    for r in range(args.rounds):
        mine = [x.linearkv for x in results if x.round == r]
        hit, missed = sum(x.get("chunks_hit", 0) for x in mine), sum(x.get("chunks_missed", 0) for x in mine)
        reused = sum(x.get("reused_tokens", 0) for x in mine)
        print(f"round {r}: {len(mine)} programs, chunks hit {hit}, missed {missed}, reused tokens {reused}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
