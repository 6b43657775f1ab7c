"""Shrink a violation to a short sequential reproduction: the op list, sent one op at a time on
an emptied cache (`/flush_cache`), that still shows the same oracle failing on the same op.

Candidates, in order (each kept with the ops it continues): the violating op alone; it with the
earlier ops that share at least `RELATED_TOKENS` leading ids with it; the last `WINDOW` ops before
it. The first that reproduces is then cut one op at a time (ddmin's last step), within `budget`
runs in all. A violation that needs ops side by side may not reproduce in sequence: then the
reproduction is the seed and its round, reported as such.
"""

from __future__ import annotations

from collections.abc import Callable

RELATED_TOKENS = 16
WINDOW = 24


def _closure(ops_by_index: dict[int, dict], keep: set[int]) -> list[dict]:
    todo, seen = list(keep), set()
    while todo:
        i = todo.pop()
        if i in seen:
            continue
        seen.add(i)
        prev = ops_by_index[i].get("continue_of")
        if prev is not None:
            todo.append(prev)
    return [ops_by_index[i] for i in sorted(seen)]


def _lead(op: dict) -> list[int]:
    if op["op"] == "batch":
        return op["prompts"][0]
    if op["op"] in ("session", "foreign_session"):
        return op["turns"][0]["ids"]
    return op["ids"]


def _shares_lead(a: dict, b: dict) -> bool:
    x, y = _lead(a), _lead(b)
    return len(x) >= RELATED_TOKENS and len(y) >= RELATED_TOKENS and x[:RELATED_TOKENS] == y[:RELATED_TOKENS]


def shrink(ops: list[dict], target: int, reproduces: Callable[[list[dict]], bool], budget: int = 10) -> dict:
    """`ops`: the workload's ops in order; `target`: the violating op's index; `reproduces(list)`
    runs a list sequentially on an emptied cache and says whether the violation shows.
    Returns {"reproduced": bool, "ops": the shortest list found, "runs": runs spent}."""
    by_index = {op["index"]: op for op in ops}
    earlier = [op for op in ops if op["index"] < target]
    related = {op["index"] for op in earlier if any(_shares_lead(op, o) for o in _closure(by_index, {target}))}
    candidates = [_closure(by_index, {target}), _closure(by_index, related | {target}),
                  _closure(by_index, {op["index"] for op in earlier[-WINDOW:]} | {target})]
    runs = 0
    found: list[dict] | None = None
    tried: set[tuple[int, ...]] = set()
    for cand in candidates:
        key = tuple(op["index"] for op in cand)
        if key in tried or runs >= budget:
            continue
        tried.add(key)
        runs += 1
        if reproduces(cand):
            found = cand
            break
    if found is None:
        return {"reproduced": False, "ops": [], "runs": runs}
    i = 0
    while i < len(found) and runs < budget:
        if found[i]["index"] == target:
            i += 1
            continue
        cand = _closure(by_index, {op["index"] for op in found if op is not found[i]})
        if len(cand) >= len(found):
            i += 1
            continue
        runs += 1
        if reproduces(cand):
            found = cand
        else:
            i += 1
    return {"reproduced": True, "ops": found, "runs": runs}
