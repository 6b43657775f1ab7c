"""A seeded generator of hostile but valid workloads for the differential exactness fuzzer.

Pure (no SGLang, no torch): `generate_workload(seed, ...)` returns a `Workload`, a list of rounds of
operations (plain JSON dicts, so a reproduction is a JSON list). The ops of one round are sent side by
side; an op may continue an earlier round's conversation (`continue_of`: its ids are appended to that
op's prompt and answer at run time). Op kinds (`op`):

* `generate`: one request; on a LinearKV server possibly with a chunk layout (`linearkv`) over tokens
  that other ops send as plain prompts;
* `batch`: one request carrying several prompts (SGLang's batch path);
* `abort`: a streamed request cut mid-decode, by a dropped connection or `/abort_request`;
* `session`: a streaming session (`/open_session` with `streaming: true`): turns appended to its
  context, the last turn possibly aborted mid-decode, then `/close_session`;
* `foreign_session`: a streaming session one tenant opens and uses, a turn another tenant sends
  with its id (which must be refused: 400 naming the field), then the owner's next turn.

A `generate` op may also ask for input logprobs from a position inside its prompt
(`logprob_start`), several answers at once (`n`), a long decode (`new` >= `LONG_DECODE`), or
sampling with a temperature and a seed (`sample`: [temperature, sampling_seed]; the servers run
`--enable-deterministic-inference`, under which SGLang's sampler draws from the seed and the
token's position, so a cache's exact answer samples what the server without cache samples).

Paths only the answer can tell (`retraction`: SGLang's `num_retractions` > 0; `pressure`: the
answer's pressure block says its arrival was pressed) are added by the client.

Every request carries a tenant (`extra_key`, `cache_salt`, or none) and, most of the time,
per-request Tail-Replay overrides (`exactness`, `budget`, `kv_mode`, `keep_checkpoints`,
`min_match_tokens`, `repair_shared`; `sglang_ext.tail_replay.config`). Documents are shared by
tenants' prompts, and tenant-private documents are sent by other tenants too (probes), so every
cross-tenant reuse would show.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

#: (extra_key, cache_salt) of the tenants: SGLang keys its prefix cache by both
TENANTS: tuple[tuple[str | None, str | None], ...] = (
    (None, None), ("tenant-a", None), ("tenant-b", None), (None, "salt-1"), ("tenant-a", "salt-2"))
EXACTNESS = ("approximate", "exact_first", "exact")
#: under a server with pressure thresholds (`WorkloadShape.pressure`), the pressure mode too
PRESSURE_EXACTNESS = (*EXACTNESS, "exact_unless_pressed")
BUDGETS = (0.0, 0.02, 0.05, 0.25, 1.0)
TOKEN_LOW, TOKEN_HIGH = 10, 500          # content ids (the tiny fixtures' vocab is 512)
#: new tokens of a long decode
LONG_DECODE = 256


@dataclass(frozen=True)
class WorkloadShape:
    """What a server configuration can take. `linearkv`: chunk layouts; `sessions`: streaming
    sessions (`--enable-streaming-session`); `max_context`: prompts (with their continuations)
    stay below it; `states`: the LinearKV state rules the server serves."""

    linearkv: bool = False
    sessions: bool = True
    max_context: int = 1500
    states: tuple[str, ...] = ("predecessor", "zero")
    #: the server has pressure thresholds: requests may ask "exact_unless_pressed"
    pressure: bool = False
    #: share of plain `generate` ops that decode `LONG_DECODE` tokens (a small KV pool then
    #: forces SGLang to retract running requests)
    long_decode_rate: float = 0.05
    #: share of plain `generate` ops that sample with a temperature and a seed
    sampled_rate: float = 0.08


@dataclass
class Workload:
    seed: int
    rounds: list[list[dict]] = field(default_factory=list)

    def ops(self) -> list[dict]:
        """All ops in order (rounds flattened); each op's `index` is its position here."""
        return [op for rnd in self.rounds for op in rnd]


def _ids(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(TOKEN_LOW, TOKEN_HIGH) for _ in range(n)]


def _overrides(rng: random.Random, pressure: bool = False) -> dict | None:
    """Per-request Tail-Replay overrides (None: the server's defaults)."""
    if rng.random() < 0.25:
        return None
    out: dict = {"exactness": rng.choice(PRESSURE_EXACTNESS if pressure else EXACTNESS)}
    if rng.random() < 0.7:
        out["budget"] = rng.choice(BUDGETS)
    if rng.random() < 0.12:
        out["kv_mode"] = "recompute"
    if rng.random() < 0.1:
        out["keep_checkpoints"] = False
    if rng.random() < 0.15:
        out["min_match_tokens"] = rng.choice((0, 16, 128))
    if rng.random() < 0.15:
        out["repair_shared"] = False
    return out


class _Builder:
    def __init__(self, seed: int, shape: WorkloadShape):
        self.rng = random.Random(seed)
        self.shape = shape
        rng = self.rng
        self.docs = [_ids(rng, rng.randint(80, 400)) for _ in range(6)]
        # one private document per tenant: only its owner sends it, except the probes
        self.private = {t: _ids(rng, rng.randint(60, 300)) for t in TENANTS}
        self.index = 0
        self.lengths: dict[int, int] = {}      # op index -> prompt length + new tokens (upper bound)

    def _op(self, kind: str, tenant, **fields) -> dict:
        op = {"index": self.index, "op": kind, "tenant": list(tenant), **fields}
        self.index += 1
        return op

    def _prompt(self, tenant) -> list[int]:
        rng = self.rng
        doc = self.private[tenant] if rng.random() < 0.2 else rng.choice(self.docs)
        cut = rng.randint(max(1, len(doc) // 3), len(doc))
        return doc[:cut] + _ids(rng, rng.randint(1, 24))

    def _generate(self, tenant, earlier: list[dict]) -> dict:
        rng = self.rng
        new = rng.randint(1, 8)
        fields: dict = {"new": new, "tail_replay": _overrides(rng, self.shape.pressure)}
        if earlier and rng.random() < 0.3:
            prev = rng.choice(earlier)
            tail = _ids(rng, rng.randint(1, 30))
            if self.lengths[prev["index"]] + len(tail) + new < self.shape.max_context:
                tenant = tuple(prev["tenant"])
                op = self._op("generate", tenant, ids=tail, continue_of=prev["index"], **fields)
                self.lengths[op["index"]] = self.lengths[prev["index"]] + len(tail) + new
                return op
        ids = self._prompt(tenant)
        if self.shape.linearkv and rng.random() < 0.35:
            fields["linearkv"] = self._layout(len(ids))
        else:
            extra = rng.random()
            long_end = 0.17 + self.shape.long_decode_rate
            if extra < 0.1:
                fields["logprob_start"] = rng.randrange(len(ids))
            elif extra < 0.17:
                fields["n"] = 2
            elif extra < long_end and len(ids) + LONG_DECODE < self.shape.max_context:
                fields["new"] = new = LONG_DECODE
            elif long_end <= extra < long_end + self.shape.sampled_rate:
                fields["sample"] = [rng.choice((0.6, 1.0, 1.3)), rng.randrange(1 << 31)]
        op = self._op("generate", tenant, ids=ids, **fields)
        self.lengths[op["index"]] = len(ids) + new
        return op

    def _layout(self, n: int) -> dict:
        """A valid chunk layout over a prompt of n ids: P, 1-4 chunks, a question of >= 1 id."""
        rng = self.rng
        start = rng.choice((0, 0, 8, 16, 24))
        cuts = sorted(rng.sample(range(start + 1, n), min(rng.randint(1, 4), max(0, n - start - 1))))
        bounds = [start, *cuts]
        spans = [[a, b] for a, b in zip(bounds, bounds[1:], strict=False)]
        if not spans:
            spans = [[start, n - 1]]
        layout: dict = {"chunks": spans}
        if rng.random() < 0.5:
            layout["state"] = rng.choice(self.shape.states)
        if rng.random() < 0.4:
            layout["selector"] = rng.choice(("none", "epic-4", "epic-8"))
        return layout

    def _plain_twin(self, op: dict) -> dict:
        """The chunked request's own tokens again, as a plain prompt asking for exactness."""
        overrides = {"exactness": "exact", "budget": self.rng.choice((0.05, 1.0))}
        twin = self._op("generate", tuple(op["tenant"]), ids=list(op["ids"]), new=op["new"], tail_replay=overrides)
        self.lengths[twin["index"]] = self.lengths[op["index"]]
        return twin

    def _batch(self, tenant) -> dict:
        rng = self.rng
        prompts = [self._prompt(tenant) for _ in range(rng.randint(2, 3))]
        op = self._op("batch", tenant, prompts=prompts, new=rng.randint(1, 6), tail_replay=_overrides(rng, self.shape.pressure))
        self.lengths[op["index"]] = max(map(len, prompts)) + op["new"]
        return op

    def _abort(self, tenant) -> dict:
        rng = self.rng
        op = self._op("abort", tenant, ids=self._prompt(tenant), new=rng.randint(24, 48),
                      tail_replay=_overrides(rng, self.shape.pressure), after_events=rng.randint(1, 3),
                      how=rng.choice(("disconnect", "abort_request")))
        self.lengths[op["index"]] = len(op["ids"]) + op["new"]
        return op

    def _session(self, tenant) -> dict:
        rng = self.rng
        turns = []
        total = 0
        for t in range(rng.randint(2, 4)):
            ids = self._prompt(tenant) if t == 0 else _ids(rng, rng.randint(1, 40))
            new = rng.randint(1, 8)
            if total + len(ids) + new >= self.shape.max_context:
                break
            total += len(ids) + new
            turns.append({"ids": ids, "new": new, "tail_replay": _overrides(rng, self.shape.pressure)})
        abort_last = len(turns) >= 2 and rng.random() < 0.5
        if abort_last:
            turns[-1]["new"] = rng.randint(24, 48)
        return self._op("session", tenant, turns=turns, abort_last=abort_last,
                        after_events=rng.randint(1, 3))

    def _foreign_session(self, tenant) -> dict:
        """A streaming session `tenant` opens, its first turn, a turn of another tenant with the
        session's id, then the owner's second turn."""
        rng = self.rng
        intruder = rng.choice([t for t in TENANTS if t != tenant])
        turns = [{"ids": self._prompt(tenant), "new": rng.randint(1, 6), "tail_replay": _overrides(rng, self.shape.pressure)},
                 {"ids": _ids(rng, rng.randint(1, 20)), "new": rng.randint(1, 4), "tail_replay": _overrides(rng, self.shape.pressure),
                  "tenant": list(intruder)},
                 {"ids": _ids(rng, rng.randint(1, 20)), "new": rng.randint(1, 6), "tail_replay": _overrides(rng, self.shape.pressure)}]
        return self._op("foreign_session", tenant, turns=turns)

    def _probe(self, tenant) -> dict:
        """Another tenant's private document (a prefix of it and a question) from this tenant."""
        rng = self.rng
        owner = rng.choice([t for t in TENANTS if t != tenant])
        doc = self.private[owner]
        ids = doc[:rng.randint(len(doc) // 2, len(doc))] + _ids(rng, rng.randint(1, 8))
        op = self._op("generate", tenant, ids=ids, new=rng.randint(1, 4), tail_replay=_overrides(rng, self.shape.pressure))
        self.lengths[op["index"]] = len(ids) + op["new"]
        return op

    def round(self, size: int, earlier: list[dict], pending: list[dict]) -> list[dict]:
        rng = self.rng
        ops: list[dict] = []
        while pending and len(ops) < size:
            ops.append(self._plain_twin(pending.pop(0)))
        while len(ops) < size:
            tenant = rng.choice(TENANTS)
            r = rng.random()
            if r < 0.45:
                op = self._generate(tenant, earlier)
                if "linearkv" in op and rng.random() < 0.6:
                    pending.append(op)
            elif r < 0.57:
                op = self._batch(tenant)
            elif r < 0.69:
                op = self._abort(tenant)
            elif r < 0.81 and self.shape.sessions:
                op = self._session(tenant)
            elif r < 0.86 and self.shape.sessions:
                op = self._foreign_session(tenant)
            else:
                op = self._probe(tenant)
            ops.append(op)
        return ops


def generate_workload(seed: int, n_ops: int, concurrency: int = 4, shape: WorkloadShape | None = None) -> Workload:
    """`n_ops` ops in rounds of `concurrency`, the same for the same arguments."""
    builder = _Builder(seed, shape or WorkloadShape())
    workload = Workload(seed)
    earlier: list[dict] = []
    pending: list[dict] = []
    while builder.index < n_ops:
        rnd = builder.round(min(concurrency, n_ops - builder.index), earlier, pending)
        workload.rounds.append(rnd)
        earlier += [op for op in rnd if op["op"] == "generate"]
    return workload


def requests_in(op: dict) -> int:
    """How many /generate requests an op sends."""
    if op["op"] == "batch":
        return len(op["prompts"])
    if op["op"] in ("session", "foreign_session"):
        return len(op["turns"])
    return op.get("n", 1)


def paths_of(op: dict) -> list[str]:
    """The request paths an op exercises (the report's `paths`): its kind, and for a `generate`
    op `chunked`, `input_logprobs`, `n_gt_1`, `long_decode`, `sampled`, `continuation` or `plain`."""
    kind = op["op"]
    if kind != "generate":
        return [kind]
    out = [name for name, on in (("chunked", "linearkv" in op), ("input_logprobs", "logprob_start" in op),
                                 ("n_gt_1", op.get("n", 1) > 1), ("long_decode", op["new"] >= LONG_DECODE),
                                 ("sampled", "sample" in op), ("continuation", "continue_of" in op)) if on]
    return out or ["plain"]
