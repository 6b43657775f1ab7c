"""Equal-bytes budgets (`--equal-bytes-gib`): every server gets the same memory in bytes of a named
real model's KV and recurrent state, and splits it its own way (no SGLang import).

The fixture is scaled by the real model's ratio of state bytes to KV bytes per token, counted in
the trace's *real* tokens: a replayed trace is scaled down (`--tokens-per-block`, e.g. 1 synthetic
token per 64-token kv-cache-tester block), so one fixture token stands for `token_scale` real tokens
(the trace's block size / tokens per block) and its KV costs `token_scale` x the real model's KV
per token. A split is a number of state slots and of fixture KV tokens whose bytes *in the real
model* fit the budget, and the fixture server gets those counts (`--max-mamba-cache-size`,
`--max-total-tokens`): one slot costs what ~3,144 real tokens of KV cost on Qwen3-Next-80B-A3B,
i.e. ~49 fixture tokens of a 1-per-64 agentic replay. Each pool holds one padding slot besides the
ones it serves (SGLang's `memory_pool.py`); both rules count it.

* stock SGLang: its own sizing when `--max-mamba-cache-size` is not given
  (`kv_cache_configurator.py`, `_resolve_memory_pool_config`, SGLang 0.5.23, no speculative
  decoding): state budget = budget x r / (1 + r), r = `--mamba-full-memory-ratio` (default 0.9);
  K = (state budget - slot) // slot state slots (the +1 padding slot fits in the same budget);
  the rest is KV. It admits K // ratio running requests (`_calculate_mamba_ratio`).
* Tail-Replay: the state slots its running batch needs (`--concurrency` x the slots SGLang reserves
  per running request under the server's strategy) plus a configurable number of checkpoint
  slots (`--tail-replay-checkpoint-slots`; several values sweep the split); the rest is KV. On one
  byte budget (Tail-Replay's default: SGLang's unified memory) this split is only where the pools
  start; the total is fixed and the split follows the workload.

Slots per running request (`_calculate_mamba_ratio`, `allocation_sizing.get_mamba_tracking_slots`):
3 (the request's state, a copy-on-write source, the state donated to the tree) plus the ping-pong
track slots of `extra_buffer` (2 with the overlap scheduler, as on a GPU) or of
`extra_buffer_lazy` (1); `auto` resolves to `extra_buffer` on a GPU with the overlap scheduler for
Qwen3-Next. A Tail-Replay server that keeps no checkpoints (`keep_checkpoints: false`) holds only
its own slots: 1 plus the track slots, the lazy variant sized for both (`patches/tail_replay/sizing.py`).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from eval.replay.real_models import RealModel
from eval.replay.servers import ServerSpec
from sglang_ext.tail_replay import BACKEND_NAME

GIB = 1 << 30
#: SGLang 0.5.23's fallback for --mamba-full-memory-ratio (arg_groups/fields/schedule.py)
DEFAULT_MAMBA_FULL_MEMORY_RATIO = 0.9
STRATEGIES = ("auto", "no_buffer", "extra_buffer", "extra_buffer_lazy")
POOL_FLAGS = ("--max-total-tokens", "--max-mamba-cache-size")


class BudgetError(ValueError):
    """A budget that cannot hold a server's split, or flags that contradict it; the message says which."""


def tracking_slots(strategy: str) -> int:
    """Ping-pong track slots per running request on a GPU (overlap scheduler on)."""
    if strategy not in STRATEGIES:
        raise BudgetError(f"--mamba-radix-cache-strategy {strategy!r}: use one of {STRATEGIES}")
    return {"no_buffer": 0, "extra_buffer_lazy": 1}.get(strategy, 2)


def slots_per_running_request(strategy: str, tree_states: bool = True) -> int:
    """State slots SGLang reserves per running request; `tree_states` False: a Tail-Replay server
    without checkpoints (its own state and its track slots only)."""
    track = tracking_slots(strategy)
    if not tree_states:
        return 1 + (2 if strategy == "extra_buffer_lazy" else track)
    return 3 + track


@dataclass(frozen=True)
class Split:
    """One server's share of the budget: state slots served (the pool holds one more, padding) and
    fixture KV tokens (each standing for `token_scale` real tokens), with their bytes in the real model."""

    server: str
    rule: str
    model: str
    budget_bytes: int
    state_slots: int
    kv_tokens: int
    state_bytes: int
    kv_bytes: int
    running_requests: int
    token_scale: float = 1.0

    def flags(self) -> list[str]:
        """The fixture server's pool flags."""
        return ["--max-total-tokens", str(self.kv_tokens), "--max-mamba-cache-size", str(self.state_slots)]

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)


def kv_bytes_per_fixture_token(model: RealModel, token_scale: float) -> float:
    """The real bytes one fixture token's KV stands for."""
    if not token_scale > 0:
        raise BudgetError(f"real tokens per fixture token must be > 0, got {token_scale}")
    return model.kv_bytes_per_token * token_scale


def _split(server: str, rule: str, model: RealModel, budget_bytes: int, slots: int, running: int,
           token_scale: float = 1.0) -> Split:
    state_bytes = (slots + 1) * model.state_bytes_per_slot
    per_token = kv_bytes_per_fixture_token(model, token_scale)
    kv_tokens = int((budget_bytes - state_bytes) // per_token)
    if slots < 1 or kv_tokens < 1:
        raise BudgetError(f"{server}: a budget of {budget_bytes / GIB:g} GiB of {model.name} cannot hold "
                          f"{slots} state slot(s) (+1 padding, {state_bytes / GIB:.3f} GiB) and any KV; raise "
                          f"--equal-bytes-gib")
    return Split(server, rule, model.name, budget_bytes, slots, kv_tokens, state_bytes,
                 int(kv_tokens * per_token), running, token_scale)


def stock_split(server: str, model: RealModel, budget_bytes: int, strategy: str = "extra_buffer",
                full_memory_ratio: float = DEFAULT_MAMBA_FULL_MEMORY_RATIO, token_scale: float = 1.0) -> Split:
    """SGLang's own split of `budget_bytes` (module docstring)."""
    if full_memory_ratio <= 0:
        raise BudgetError(f"{server}: --mamba-full-memory-ratio must be > 0, got {full_memory_ratio}")
    slot = model.state_bytes_per_slot
    state_budget = budget_bytes * full_memory_ratio / (1 + full_memory_ratio)
    slots = int((state_budget - slot) // slot)
    per_request = slots_per_running_request(strategy)
    running = slots // per_request
    if running < 1:
        raise BudgetError(f"{server}: SGLang's sizing gives {slots} state slot(s), fewer than the {per_request} "
                          f"one running request needs under {strategy}; raise --equal-bytes-gib")
    return _split(server, f"SGLang sizing, {strategy}, --mamba-full-memory-ratio {full_memory_ratio:g}",
                  model, budget_bytes, slots, running, token_scale)


def tail_replay_split(server: str, model: RealModel, budget_bytes: int, running: int, checkpoint_slots: int,
                      strategy: str = "extra_buffer", tree_states: bool = True, token_scale: float = 1.0) -> Split:
    """Tail-Replay's rule: the running batch's slots plus `checkpoint_slots`, the rest KV."""
    if checkpoint_slots < 0 or running < 1:
        raise BudgetError(f"{server}: checkpoint slots must be >= 0 and running requests >= 1")
    per_request = slots_per_running_request(strategy, tree_states)
    slots = running * per_request + checkpoint_slots
    rule = (f"{running} running x {per_request} slots ({strategy}"
            f"{'' if tree_states else ', no checkpoints'}) + {checkpoint_slots} checkpoint slots")
    return _split(server, rule, model, budget_bytes, slots, running, token_scale)


def _flag_value(args: list[str], flag: str) -> str | None:
    """The last value of `flag` in `args` (`--flag v` or `--flag=v`), None if absent."""
    value = None
    for i, arg in enumerate(args):
        if arg == flag and i + 1 < len(args):
            value = args[i + 1]
        elif arg.startswith(flag + "="):
            value = arg[len(flag) + 1:]
    return value


def equal_bytes_specs(specs: list[ServerSpec], common: list[str], model: RealModel, budget_bytes: int,
                      running: int, checkpoint_slots: list[int], token_scale: float = 1.0) -> list[tuple[ServerSpec, Split]]:
    """Every spec with its split; a tail_replay spec once per `checkpoint_slots` value (labelled
    `LABEL@Nckpt` when there are several: the sweep). `common`: the arguments every server gets;
    `token_scale`: real tokens per fixture token."""
    if not checkpoint_slots:
        raise BudgetError("--tail-replay-checkpoint-slots: give at least one value")
    out: list[tuple[ServerSpec, Split]] = []
    for spec in specs:
        args = spec.launch_args(common)
        for flag in POOL_FLAGS:
            if _flag_value(args, flag) is not None:
                raise BudgetError(f"--servers {spec.label!r}: {flag} contradicts --equal-bytes-gib (the budget "
                                  "sets each server's pools)")
        strategy = _flag_value(args, "--mamba-radix-cache-strategy") or "auto"
        if spec.kind != BACKEND_NAME:
            ratio = _flag_value(args, "--mamba-full-memory-ratio")
            try:
                r = DEFAULT_MAMBA_FULL_MEMORY_RATIO if ratio is None else float(ratio)
            except ValueError:
                raise BudgetError(f"--servers {spec.label!r}: --mamba-full-memory-ratio {ratio!r} is not a number") from None
            out.append((spec, stock_split(spec.label, model, budget_bytes, strategy, r, token_scale)))
            continue
        tree_states = (spec.tail_replay_config or {}).get("keep_checkpoints", True) is not False
        counts = checkpoint_slots if tree_states else [0]
        for n in dict.fromkeys(counts):
            label = spec.label if len(counts) == 1 else f"{spec.label}@{n}ckpt"
            out.append((dataclasses.replace(spec, label=label),
                        tail_replay_split(label, model, budget_bytes, running, n, strategy, tree_states,
                                          token_scale)))
    return out


def split_table(rows: list[dict]) -> str:
    """report.md's table of the servers' splits: report rows with a `memory_split`
    (`Split.as_dict`) and, where read, the pools the server says it holds (`server_pools`)."""
    lines = ["| server | state slots (+1 padding) | KV tokens (fixture) | real tokens per fixture token | state GiB "
             "| KV GiB | running requests | rule "
             "| server holds: KV tokens / slots / running |",
             "|---|---:|---:|---:|---:|---:|---:|---|---|"]
    for row in rows:
        s = row["memory_split"]
        scale = s.get("token_scale", 1.0)
        held = "; ".join(f"{p['kv_tokens']} / {p['state_slots']} / {p['max_running_requests']}"
                         for p in row.get("server_pools") or []) or "-"
        lines.append(f"| {s['server']} | {s['state_slots']} | {s['kv_tokens']:,} | {scale:g} | {s['state_bytes'] / GIB:.3f} | "
                     f"{s['kv_bytes'] / GIB:.3f} | {s['running_requests']} | {s['rule']} | {held} |")
    return "\n".join(lines)
