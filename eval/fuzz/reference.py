"""Answers of a server without cache (`eval.fuzz.configs.no_cache_server`), kept per (ids, new
tokens), and the float noise between two of its runs, from which the exactness tolerance follows."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import requests

from eval.fuzz.client import sampling

#: the exactness oracle's tolerance on output logprobs: this floor, or NOISE_FACTOR times the
#: measured noise between two runs of the server without cache, whichever is larger
TOLERANCE_FLOOR = 1e-4
NOISE_FACTOR = 10.0


class NoCacheReference:
    """`ref(ids, new, logprob_start=-1, sample=None) -> (output ids, logprobs)`: greedy, or sampled
    with `sample` = [temperature, seed] (SGLang's seeded sampler), EOS ignored; the logprobs are the
    input logprobs from `logprob_start` (none for -1) then the output logprobs
    (`oracles.read_logprobs` lays a cached answer out the same way)."""

    def __init__(self, url: str):
        self.url = url
        self.answers: dict[tuple, tuple[list[int], list[float]]] = {}

    def ask(self, ids: list[int], new: int, logprob_start: int = -1,
            sample: list | None = None) -> tuple[list[int], list[float]]:
        payload = {"input_ids": list(ids), "return_logprob": True, "sampling_params": sampling(new, sample)}
        if logprob_start >= 0:
            payload["logprob_start_len"] = logprob_start
        resp = requests.post(f"{self.url}/generate", json=payload, timeout=600)
        resp.raise_for_status()
        out = resp.json()
        meta = out["meta_info"]
        read = [x[0] for x in meta.get("input_token_logprobs") or () if x[0] is not None] if logprob_start >= 0 else []
        return list(out["output_ids"]), read + [x[0] for x in meta["output_token_logprobs"]]

    def ask_batch(self, prompts: list[list[int]], new: int) -> list[tuple[list[int], list[float]]]:
        """The same batch request as a client's (one /generate with a list of prompts)."""
        payload = {"input_ids": [list(p) for p in prompts], "return_logprob": True,
                   "sampling_params": {"max_new_tokens": new, "temperature": 0, "ignore_eos": True}}
        resp = requests.post(f"{self.url}/generate", json=payload, timeout=600)
        resp.raise_for_status()
        return [(list(item["output_ids"]), [x[0] for x in item["meta_info"]["output_token_logprobs"]])
                for item in resp.json()]

    def __call__(self, ids: list[int], new: int, logprob_start: int = -1,
                 sample: list | None = None) -> tuple[list[int], list[float]]:
        key = (tuple(ids), new, logprob_start, tuple(sample) if sample else None)
        if key not in self.answers:
            self.answers[key] = self.ask(ids, new, logprob_start, sample)
        return self.answers[key]

    def prefetch(self, items: list[tuple], concurrency: int = 4) -> None:
        """Ask for several answers (ids, new tokens, logprob start, sample) side by side (the
        server batches them)."""
        todo = list({(tuple(ids), new, start, tuple(sample) if sample else None) for ids, new, start, sample in items}
                    - set(self.answers))
        with ThreadPoolExecutor(concurrency) as pool:
            answers = pool.map(lambda k: self.ask(list(k[0]), k[1], k[2], list(k[3]) if k[3] else None), todo)
            for key, answer in zip(todo, answers, strict=True):
                self.answers[key] = answer


def measure_noise(ref: NoCacheReference, prompts: list[list[int]], new: int = 8) -> dict:
    """The same prompts one at a time, then all side by side (other batch shapes, other chunking of
    the batch): the largest output-logprob difference and whether every greedy token agreed."""
    alone = [ref.ask(p, new) for p in prompts]
    with ThreadPoolExecutor(len(prompts) or 1) as pool:
        together = list(pool.map(lambda p: ref.ask(p, new), prompts))
    same_tokens = all(a[0] == b[0] for a, b in zip(alone, together, strict=True))
    noise = max((abs(x - y) for a, b in zip(alone, together, strict=True) for x, y in zip(a[1], b[1], strict=False)),
                default=0.0)
    return {"prompts": len(prompts), "new_tokens": new, "max_logprob_diff": noise, "same_tokens": same_tokens,
            "tolerance": max(TOLERANCE_FLOOR, NOISE_FACTOR * noise)}
