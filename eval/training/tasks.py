"""RULER-style synthetic tasks at a token budget, for training and held-out evaluation.

Prompts use RULER's own templates (shipped in `nvidia-long-context-eval`) and its task
variants (needle-in-a-haystack single / multi-key / multi-value / multi-query, variable
tracking, QA over documents). A sample's prompt ends with RULER's answer prefix; its `target`
is the completion a model should write (used for training), `answers` what RULER scores.

`make_sample(task, length, rng, tokenizer, split)` is deterministic given the rng state.
"""

from __future__ import annotations

import random
import string
import uuid
from dataclasses import dataclass
from functools import lru_cache

from eval import corpus

REPEAT_NOISE = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."
NEEDLE = "One of the special magic {type_v} for {key} is: {value}."


@dataclass(frozen=True)
class NiahSpec:
    haystack: str  # essay | repeat | needle
    key_type: str = "words"  # words | numbers | uuids
    value_type: str = "numbers"
    num_keys: int = 1
    num_values: int = 1
    num_queries: int = 1


NIAH_TASKS = {
    "niah_single_1": NiahSpec("repeat"),
    "niah_single_2": NiahSpec("essay"),
    "niah_single_3": NiahSpec("essay", value_type="uuids"),
    "niah_multikey_1": NiahSpec("essay", num_keys=4),
    "niah_multikey_2": NiahSpec("needle"),
    "niah_multikey_3": NiahSpec("needle", key_type="uuids", value_type="uuids"),
    "niah_multivalue": NiahSpec("essay", num_values=4),
    "niah_multiquery": NiahSpec("essay", num_keys=4, num_queries=4),
}
OTHER_TASKS = ("vt", "qa_1", "qa_2")
ALL_TASKS = (*NIAH_TASKS, *OTHER_TASKS)
#: task variants kept out of training (evaluated only)
HELD_OUT_TASKS = ("niah_single_3", "niah_multikey_3", "qa_2")
TRAIN_TASKS = tuple(t for t in ALL_TASKS if t not in HELD_OUT_TASKS)
#: RULER's metric per task: all references must appear, or any one
METRIC = {**{t: "string_match_all" for t in (*NIAH_TASKS, "vt")}, "qa_1": "string_match_part", "qa_2": "string_match_part"}
TOKENS_TO_GENERATE = {**{t: 64 for t in NIAH_TASKS}, "niah_single_3": 48, "niah_multikey_3": 48,
                      "niah_multivalue": 48, "niah_multiquery": 48, "vt": 30, "qa_1": 32, "qa_2": 32}


@dataclass(frozen=True)
class Sample:
    task: str
    length: int  # token budget: prompt + tokens_to_generate
    prompt: str
    answers: tuple[str, ...]
    target: str
    tokens_to_generate: int


def ruler_template(task: str) -> tuple[str, str]:
    from long_context_eval.data.synthetic.constants import TASKS

    base = "niah" if task.startswith("niah") else "variable_tracking" if task == "vt" else "qa"
    return TASKS[base]["template"], TASKS[base]["answer_prefix"]


@lru_cache(maxsize=1)
def _words() -> tuple[str, ...]:
    from wonderwords import random_word

    nouns = random_word._get_words_from_text_file("nounlist.txt")
    adjs = random_word._get_words_from_text_file("adjectivelist.txt")
    return tuple(sorted({f"{a}-{n}" for a in adjs[:300] for n in nouns[:600]}))


def _random(kind: str, rng: random.Random) -> str:
    if kind == "numbers":
        return str(rng.randint(10**6, 10**7 - 1))
    if kind == "words":
        return rng.choice(_words())
    if kind == "uuids":
        return str(uuid.UUID(int=rng.getrandbits(128), version=4))
    raise ValueError(f"unknown needle type {kind!r}")


class TokenCounter:
    """Token counts of texts, cached (haystack sentences repeat across samples)."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self._cache: dict[str, int] = {}

    def __call__(self, text: str) -> int:
        if text not in self._cache:
            self._cache[text] = len(self.tokenizer.encode(text).ids)
        return self._cache[text]


def _fill(pool, budget: int, count: TokenCounter, rng: random.Random, contiguous: bool) -> list[str]:
    """Consecutive (or random) items of `pool` whose token counts add up to about `budget`
    (random items: stop before the first one that would overshoot it)."""
    out, used = [], 0
    start = rng.randrange(len(pool))
    while used < budget:
        item = pool[(start + len(out)) % len(pool)] if contiguous else rng.choice(pool)
        if not contiguous and used + count(item) > budget:
            break
        used += count(item) + 1
        out.append(item)
    return out


def _insert(items: list[str], extra: list[str], rng: random.Random) -> list[str]:
    """`extra` inserted, in order, at random positions of `items`."""
    slots = sorted(rng.randrange(len(items) + 1) for _ in extra)
    out = list(items)
    for offset, (slot, text) in enumerate(zip(slots, extra)):
        out.insert(slot + offset, text)
    return out


def _niah(task: str, spec: NiahSpec, budget: int, count, rng, split) -> tuple[str, str, tuple, str]:
    template, prefix = ruler_template(task)
    keys = []
    while len(keys) < spec.num_keys:
        key = _random(spec.key_type, rng)
        keys.append(key) if key not in keys else None
    values = [[_random(spec.value_type, rng) for _ in range(spec.num_values)] for _ in keys]
    needles = [NEEDLE.format(type_v=spec.value_type, key=k, value=v) for k, vs in zip(keys, values) for v in vs]
    rng.shuffle(needles)
    queried = rng.sample(range(len(keys)), spec.num_queries)
    answers = tuple(v for i in queried for v in values[i])
    query = ", ".join(keys[i] for i in queried[:-1]) + ", and " + keys[queried[-1]] if len(queried) > 1 else keys[queried[0]]
    type_v = spec.value_type
    if len(answers) == 1:
        template = template.replace("Some", "A").replace("are all", "is").replace("are", "is")
        prefix = prefix.replace("are", "is")
        type_v = type_v[:-1]
    budget -= sum(count(n) + 1 for n in needles)
    if spec.haystack == "essay":
        context = " ".join(_insert(_fill(corpus.essay_sentences(split), budget, count, rng, True), needles, rng))
    elif spec.haystack == "repeat":
        context = "\n".join(_insert([REPEAT_NOISE] * max(1, budget // (count(REPEAT_NOISE) + 1)), needles, rng))
    else:
        one = count(NEEDLE.format(type_v=spec.value_type, key=keys[0], value=values[0][0])) + 1
        distractors = [NEEDLE.format(type_v=spec.value_type, key=_random(spec.key_type, rng), value=_random(spec.value_type, rng))
                       for _ in range(max(1, budget // one))]
        context = "\n".join(_insert(distractors, needles, rng))
    prompt = template.format(type_needle_v=type_v, context=context, query=query) + prefix.format(type_needle_v=type_v, query=query)
    return prompt, " " + ", ".join(answers) + ".", answers


def _vt(budget: int, count, rng) -> tuple[str, str, tuple]:
    template, prefix = ruler_template("vt")
    names: list[str] = []
    while len(names) < 5:
        name = "".join(rng.choices(string.ascii_uppercase, k=5))
        names.append(name) if name not in names else None
    value = str(rng.randint(10000, 99999))
    chain = [f"VAR {names[0]} = {value}"] + [f"VAR {names[i + 1]} = VAR {names[i]} " for i in range(4)]
    budget -= sum(count(c) + 1 for c in chain)
    noise = [REPEAT_NOISE] * max(len(chain), budget // (count(REPEAT_NOISE) + 1))
    slots = sorted(rng.sample(range(len(noise)), len(chain)))
    for offset, (slot, text) in enumerate(zip(slots, chain)):
        noise.insert(slot + offset, text)
    prompt = template.format(context="\n".join(noise), query=value) + prefix.format(num_v=len(names), query=value)
    return prompt, " ".join(names), tuple(names)


def _qa(task: str, budget: int, count, rng, split) -> tuple[str, str, tuple]:
    template, prefix = ruler_template("qa")
    qa = corpus.squad(split) if task == "qa_1" else corpus.hotpotqa(split)
    item = rng.choice(qa.items)
    budget -= sum(count(g) + 8 for g in item.gold) + count(item.question)
    docs = _fill(qa.paragraphs, budget, count, rng, False) if budget > 0 else []
    docs = _insert([d for d in docs if d not in item.gold], list(item.gold), rng)
    context = "\n\n".join(f"Document {i + 1}:\n{d}" for i, d in enumerate(docs))
    prompt = template.format(context=context, query=item.question) + prefix
    return prompt, " " + item.answers[0], item.answers


#: training-only task (not RULER): many needles, then many questions, each answered; a dense
#: associative-recall signal that teaches the attention layers to copy the asked value
DENSE_RECALL = "dense_recall"
DENSE_QUESTION = ("What is the special magic number for {key} mentioned in the provided text? "
                  "The special magic number for {key} mentioned in the provided text is")


def dense_recall_segments(length: int, rng: random.Random, tokenizer, split: str = "train",
                          counter: TokenCounter | None = None) -> list[tuple[str, bool]]:
    """(text, is_answer) pieces: needles among essay sentences, then questions with answers."""
    count = counter or TokenCounter(tokenizer)
    keys = list(dict.fromkeys(_random("words", rng) for _ in range(max(3, length // 64))))
    values = {k: _random("numbers", rng) for k in keys}
    asked = rng.sample(keys, min(len(keys), max(2, length // 128)))
    qa_cost = len(asked) * (count(DENSE_QUESTION.format(key=asked[0])) + 10)
    needles = [NEEDLE.format(type_v="numbers", key=k, value=values[k]) for k in keys]
    budget = length - qa_cost - sum(count(n) + 1 for n in needles)
    filler = _fill(corpus.essay_sentences(split), max(0, budget), count, rng, True) if budget > 0 else []
    context = " ".join(_insert(filler, needles, rng))
    pieces = [(context + "\n", False)]
    for key in asked:
        pieces += [(DENSE_QUESTION.format(key=key), False), (f" {values[key]}.", True), ("\n", False)]
    return pieces


def make_sample(task: str, length: int, rng: random.Random, tokenizer, split: str = "train",
                counter: TokenCounter | None = None) -> Sample:
    """One sample of `task` whose prompt is about `length - tokens_to_generate` tokens."""
    if task not in ALL_TASKS:
        raise ValueError(f"unknown task {task!r}; choose from {list(ALL_TASKS)}")
    count = counter or TokenCounter(tokenizer)
    gen = TOKENS_TO_GENERATE[task]
    template, _ = ruler_template(task)
    budget = length - gen - count(template) - 30
    if task in NIAH_TASKS:
        prompt, target, answers = _niah(task, NIAH_TASKS[task], budget, count, rng, split)
    elif task == "vt":
        prompt, target, answers = _vt(budget, count, rng)
    else:
        prompt, target, answers = _qa(task, budget, count, rng, split)
    return Sample(task, length, prompt, answers, target, gen)
