"""Seeded synthetic typed workload: multi-turn agent/chat sessions plus templated
single-turn traffic, with a mix that can shift between phases.

Sessions share one of a few system prompts; each turn appends a user query or a tool
output, and the model's answer (reasoning + response, or a tool call) is cached at the
end of the turn. Templated requests share one of ``n_templates`` prompts (Zipf
popularity) followed by a unique query. Gaps between turns depend on what the model
produced: a tool call is followed by a tool output after ``tool_gap_s``, a response by
the user's next query after ``user_gap_s`` (both log-normal).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .trace import BlockTable, Request, Trace


@dataclass(frozen=True)
class WorkloadMix:
    session_share: float = 0.5  # fraction of arrivals that start a multi-turn session
    tool_call_share: float = 0.6  # chance that a turn ends in a tool call
    tool_gap_s: float = 8.0  # median gap tool call -> tool output
    user_gap_s: float = 240.0  # median gap response -> next user query
    gap_sigma: float = 0.8
    continue_prob: float = 0.85  # chance that a session has another turn
    n_system_prompts: int = 4
    system_blocks: int = 24
    n_templates: int = 40
    template_blocks: int = 16
    query_blocks: int = 3
    tool_output_blocks: int = 12
    response_blocks: int = 4
    reasoning_blocks: int = 3


@dataclass(frozen=True)
class SyntheticSpec:
    phases: tuple[tuple[WorkloadMix, float], ...] = ((WorkloadMix(), 3600.0),)  # (mix, seconds)
    arrival_rate: float = 1.0  # new sessions or templated requests per second
    seed: int = 0
    block_tokens: int = 64


SHIFTED_MIX = WorkloadMix(session_share=0.3, tool_call_share=0.3, tool_gap_s=200.0,
                          user_gap_s=6.0, template_blocks=24, n_templates=80)


def default_spec(seed: int = 0) -> SyntheticSpec:
    """One hour of the default mix, then one hour of the shifted mix."""
    return SyntheticSpec(phases=((WorkloadMix(), 3600.0), (SHIFTED_MIX, 3600.0)), seed=seed)


def generate(spec: SyntheticSpec) -> Trace:
    rng = np.random.default_rng(spec.seed)
    table, requests = BlockTable(), []
    builder = _Builder(table, rng, requests)
    t0 = 0.0
    for mix, duration in spec.phases:
        for arrival in _poisson(rng, spec.arrival_rate, t0, t0 + duration):
            if rng.random() < mix.session_share:
                builder.session(mix, arrival)
            else:
                builder.templated(mix, arrival)
        t0 += duration
    end = t0
    kept = [r for r in requests if r.time < end]
    return table.freeze(f"synthetic(seed={spec.seed})", spec.block_tokens, kept,
                        (f"{len(spec.phases)} phase(s), {spec.arrival_rate:g} arrivals/s",))


def _poisson(rng, rate: float, start: float, stop: float):
    t = start
    while True:
        t += rng.exponential(1.0 / rate)
        if t >= stop:
            return
        yield t


class _Builder:
    def __init__(self, table: BlockTable, rng, requests: list) -> None:
        self.table, self.rng, self.requests = table, rng, requests
        self.sessions = 0
        self.singles = 0

    def templated(self, mix: WorkloadMix, t: float) -> None:
        template = min(int(self.rng.zipf(1.3)) - 1, mix.n_templates - 1)
        self.singles += 1
        keys = [("template", mix.template_blocks, template, i) for i in range(mix.template_blocks)]
        keys += [("query", self.singles, i) for i in range(mix.query_blocks)]
        types = ["system"] * mix.template_blocks + ["user"] * mix.query_blocks
        last = self.table.intern_path(keys, types)
        self.requests.append(Request(time=t, last_block=last, prompt_tokens=len(keys) * 64))

    def session(self, mix: WorkloadMix, t: float) -> None:
        sid = self.sessions = self.sessions + 1
        system = int(self.rng.integers(mix.n_system_prompts))
        path = [("system", system, i) for i in range(mix.system_blocks)]
        types = ["system"] * mix.system_blocks
        appended = ("user", mix.query_blocks)
        for _turn in range(64):
            path, types = _extend(path, types, sid, appended)
            prompt_last = self.table.intern_path(path, types)
            tool_call = self.rng.random() < mix.tool_call_share
            output = _output_segments(mix, tool_call)
            out_path, out_types = path, types
            for segment in output:
                out_path, out_types = _extend(out_path, out_types, sid, segment)
            out_last = self.table.intern_path(out_path, out_types)
            self.requests.append(Request(time=t, last_block=prompt_last,
                                         prompt_tokens=len(path) * 64, session=sid,
                                         output_last_block=out_last))
            if self.rng.random() > mix.continue_prob:
                return
            path, types = out_path, out_types
            gap = mix.tool_gap_s if tool_call else mix.user_gap_s
            t += float(self.rng.lognormal(np.log(gap), mix.gap_sigma))
            appended = ("tool_output", mix.tool_output_blocks) if tool_call else ("user", mix.query_blocks)


def _output_segments(mix: WorkloadMix, tool_call: bool):
    if tool_call:
        return [("reasoning", mix.reasoning_blocks), ("tool_call", 1)]
    return [("reasoning", mix.reasoning_blocks), ("response", mix.response_blocks)]


def _extend(path, types, sid, segment):
    kind, count = segment
    start = len(path)
    return (path + [("session", sid, start + i) for i in range(count)], types + [kind] * count)
