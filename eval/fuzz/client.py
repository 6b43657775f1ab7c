"""Send a fuzzer workload (`eval.fuzz.workload`) to a live server and record what came back.

`run_ops(url, rounds)` sends each round's ops side by side (a thread per op) and returns one
observation per /generate request (a plain dict, JSON-ready):

    {"op": index, "part": j, "kind": op kind, "status": HTTP status (0: no answer),
     "tenant": [extra_key, cache_salt], "ids": the full context the model saw, "new": max new tokens,
     "output_ids": [...], "logprobs": [...] (output tokens), "cached_tokens": int | None,
     "details": meta_info["cached_tokens_details"] or {}, "tail_replay": the request's overrides,
     "chunked": bool, "completed": the answer has all its tokens, "round": r, "error": str | None,
     "answered": a whole /generate answer was read (not a cut stream), "paths": the op's paths,
     "logprob_start": where input logprobs start (-1: none), "input_logprobs": [...],
     "expect": "refused" for a turn that must be refused (another tenant's session turn),
     "sample": [temperature, seed] or None (greedy), "retractions": SGLang's `num_retractions`}

An answer adds the paths only it can tell: `retraction` (it was retracted at least once) and
`pressure` (its label's pressure block names thresholds its arrival met).

A session turn's `ids` is the session's context (earlier turns' prompts and answers, then its own
ids), as SGLang's streaming session builds it; an aborted turn leaves the context as it was.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import requests

#: a request without an answer after this long is a hang (the tiny CPU models answer in seconds,
#: also on shared cores); the observation then has status 0 and error "timeout: ..."
TIMEOUT_S = 120.0


def _tenant_fields(tenant: list) -> dict:
    extra_key, salt = tenant
    return {**({"extra_key": extra_key} if extra_key else {}), **({"cache_salt": salt} if salt else {})}


def sampling(new: int, sample: list | None = None) -> dict:
    """Greedy, or (`sample`: [temperature, seed]) sampled with SGLang's seeded sampler; EOS ignored."""
    if sample is None:
        return {"max_new_tokens": new, "temperature": 0, "ignore_eos": True}
    return {"max_new_tokens": new, "temperature": sample[0], "sampling_seed": sample[1], "ignore_eos": True}


def _params(new: int, overrides: dict | None, linearkv: dict | None = None, n: int = 1,
            sample: list | None = None) -> dict:
    custom = {**({"tail_replay": overrides} if overrides else {}), **({"linearkv": linearkv} if linearkv else {})}
    return {**sampling(new, sample), **({"n": n} if n > 1 else {}), **({"custom_params": custom} if custom else {})}


def _obs(op: dict, part: int, ids: list[int], new: int, overrides: dict | None, **fields) -> dict:
    from eval.fuzz.workload import paths_of

    base = {"op": op["index"], "part": part, "kind": op["op"], "status": 0, "tenant": op["tenant"], "ids": ids,
            "new": new, "output_ids": [], "logprobs": [], "cached_tokens": None, "details": {},
            "tail_replay": overrides, "chunked": "linearkv" in op, "completed": False, "error": None,
            "answered": False, "paths": paths_of(op), "logprob_start": op.get("logprob_start", -1),
            "input_logprobs": [], "chunks_end": op["linearkv"]["chunks"][-1][1] if "linearkv" in op else 0,
            "sample": op.get("sample"), "retractions": 0}
    return {**base, **fields}


def _fill(obs: dict, resp: requests.Response, item: dict | None = None) -> dict:
    obs["status"] = resp.status_code
    if resp.status_code != 200:
        obs["error"] = resp.text[:400]
        return obs
    item = item if item is not None else resp.json()
    meta = item.get("meta_info") or {}
    obs["answered"] = True
    obs["input_logprobs"] = [x[0] for x in meta.get("input_token_logprobs") or () if x[0] is not None]
    obs["output_ids"] = list(item.get("output_ids") or ())
    obs["logprobs"] = [x[0] for x in meta.get("output_token_logprobs") or ()]
    obs["cached_tokens"] = meta.get("cached_tokens")
    obs["details"] = meta.get("cached_tokens_details") or {}
    obs["completed"] = len(obs["output_ids"]) == obs["new"]
    obs["retractions"] = int(meta.get("num_retractions") or 0)
    label = obs["details"].get("tail_replay")
    pressed = isinstance(label, dict) and isinstance(label.get("pressure"), dict) and label["pressure"].get("pressed_by")
    obs["paths"] = [*obs["paths"], *(["retraction"] if obs["retractions"] else []), *(["pressure"] if pressed else [])]
    return obs


def _post(url: str, payload: dict) -> requests.Response:
    return requests.post(f"{url}/generate", json=payload, timeout=TIMEOUT_S)


def _stream_cut(url: str, payload: dict, after_events: int, how: str) -> tuple[int, list[int], str | None]:
    """A streamed request cut after `after_events` events: (status, output ids seen, error)."""
    payload = {**payload, "stream": True, "rid": payload.get("rid") or uuid.uuid4().hex}
    seen: list[int] = []
    with requests.post(f"{url}/generate", json=payload, stream=True, timeout=TIMEOUT_S) as resp:
        if resp.status_code != 200:
            return resp.status_code, seen, resp.text[:400]
        events = 0
        for line in resp.iter_lines():
            if not line or not line.startswith(b"data:") or line[5:].strip() == b"[DONE]":
                continue
            chunk = json.loads(line[5:])
            if "error" in chunk:
                return resp.status_code, seen, str(chunk["error"])[:400]
            seen = list(chunk.get("output_ids") or seen)
            events += 1
            if events >= after_events:
                break
        if how == "abort_request":
            requests.post(f"{url}/abort_request", json={"rid": payload["rid"]}, timeout=60)
        return resp.status_code, seen, None   # leaving the block drops the connection (disconnect)


def _generate(url: str, op: dict, context: Callable[[int], list[int] | None]) -> list[dict]:
    ids = list(op["ids"])
    if "continue_of" in op:
        prev = context(op["continue_of"])
        if prev is None:
            return []   # the conversation it continues has no answer
        ids = prev + ids
    n = op.get("n", 1)
    payload = {"input_ids": ids, "return_logprob": True, **_tenant_fields(op["tenant"]),
               "sampling_params": _params(op["new"], op["tail_replay"], op.get("linearkv"), n, op.get("sample"))}
    if "logprob_start" in op:
        payload["logprob_start_len"] = op["logprob_start"]
    resp = _post(url, payload)
    obs = [_obs(op, j, ids, op["new"], op["tail_replay"]) for j in range(n)]
    if n == 1:
        return [_fill(obs[0], resp)]
    items = resp.json() if resp.status_code == 200 else [None] * n
    return [_fill(o, resp, item) for o, item in zip(obs, items, strict=True)]


def _batch(url: str, op: dict) -> list[dict]:
    payload = {"input_ids": op["prompts"], "return_logprob": True, **_tenant_fields(op["tenant"]),
               "sampling_params": _params(op["new"], op["tail_replay"])}
    resp = _post(url, payload)
    obs = [_obs(op, j, list(p), op["new"], op["tail_replay"]) for j, p in enumerate(op["prompts"])]
    items = resp.json() if resp.status_code == 200 else [None] * len(obs)
    return [_fill(o, resp, item) for o, item in zip(obs, items, strict=True)]


def _abort(url: str, op: dict) -> list[dict]:
    obs = _obs(op, 0, list(op["ids"]), op["new"], op["tail_replay"])
    payload = {"input_ids": op["ids"], **_tenant_fields(op["tenant"]), "sampling_params": _params(op["new"], op["tail_replay"])}
    obs["status"], obs["output_ids"], obs["error"] = _stream_cut(url, payload, op["after_events"], op["how"])
    return [obs]


def _session(url: str, op: dict) -> list[dict]:
    """A streaming session's turns, in order. A `session` op's last turn may be cut mid-decode
    (`abort_last`); a `foreign_session` op's turn that names another tenant is sent under that
    tenant with the session's id (expected: refused) and leaves the session's context as it was."""
    sid = f"fuzz-{op['index']}-{uuid.uuid4().hex[:8]}"
    resp = requests.post(f"{url}/open_session", json={"capacity_of_str_len": 1 << 20, "session_id": sid,
                                                      "streaming": True}, timeout=60)
    if resp.status_code != 200:
        return [_obs(op, 0, list(op["turns"][0]["ids"]), 0, None, status=resp.status_code, error=resp.text[:400])]
    out, context = [], []
    try:
        for j, turn in enumerate(op["turns"]):
            foreign = "tenant" in turn
            tenant = turn["tenant"] if foreign else op["tenant"]
            ids = list(turn["ids"]) if foreign else context + list(turn["ids"])
            payload = {"input_ids": turn["ids"], "session_params": {"id": sid}, **_tenant_fields(tenant),
                       "sampling_params": _params(turn["new"], turn["tail_replay"])}
            obs = _obs(op, j, ids, turn["new"], turn["tail_replay"], tenant=list(tenant),
                       **({"expect": "refused"} if foreign else {}))
            if op.get("abort_last") and j == len(op["turns"]) - 1:
                obs["status"], obs["output_ids"], obs["error"] = _stream_cut(url, payload, op["after_events"], "disconnect")
                out.append(obs)
                break
            obs = _fill(obs, _post(url, {**payload, "return_logprob": True}))
            out.append(obs)
            if foreign:
                continue
            if obs["status"] != 200:
                break
            context = ids + obs["output_ids"]
    finally:
        requests.post(f"{url}/close_session", json={"session_id": sid}, timeout=60)
    return out


def run_op(url: str, op: dict, context: Callable[[int], list[int] | None]) -> list[dict]:
    """Send one op; never raises for HTTP or protocol errors (status 0 and the error instead)."""
    try:
        if op["op"] == "generate":
            return _generate(url, op, context)
        if op["op"] == "batch":
            return _batch(url, op)
        if op["op"] == "abort":
            return _abort(url, op)
        if op["op"] in ("session", "foreign_session"):
            return _session(url, op)
    except requests.Timeout as err:
        return [_obs(op, 0, list(op.get("ids") or []), 0, None, error=f"timeout: no answer in {TIMEOUT_S:.0f} s ({err})"[:400])]
    except (requests.RequestException, ValueError) as err:
        return [_obs(op, 0, list(op.get("ids") or []), 0, None, error=f"{type(err).__name__}: {str(err)[:300]}")]
    raise ValueError(f"unknown op kind {op['op']!r}")


def run_ops(url: str, rounds: list[list[dict]], after_round: Callable[[int, list[dict]], None] | None = None,
            observations: list[dict] | None = None) -> list[dict]:
    """Send the rounds in order, each round's ops side by side; `after_round(r, its observations)`
    runs after each round (e.g. a check that the server is up; it may raise to stop the run).
    Returns the observations, also appended to `observations` as they come (kept if a round raises)."""
    answers: dict[int, list[int]] = {}

    def context(index: int) -> list[int] | None:
        return answers.get(index)

    observations = [] if observations is None else observations
    with ThreadPoolExecutor(max(1, max(map(len, rounds), default=1))) as pool:
        for r, rnd in enumerate(rounds):
            this_round: list[dict] = []
            for obs_list in pool.map(lambda op: run_op(url, op, context), rnd):
                for obs in obs_list:
                    obs["round"] = r
                    if obs["kind"] == "generate" and obs["completed"]:
                        answers[obs["op"]] = obs["ids"] + obs["output_ids"]
                this_round += obs_list
            observations += this_round
            if after_round is not None:
                after_round(r, this_round)
    return observations
