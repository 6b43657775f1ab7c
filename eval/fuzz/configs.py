"""The server configurations the fuzzer runs against, and the server without cache it compares with.

Every configuration: the tiny fp32 fixture, pools small enough that KV and states are evicted all
the time (`--max-total-tokens`, `--max-mamba-cache-size`), chunked prefill of 64 tokens, streaming
sessions on, metrics on (the idle check's counter), and SGLang's strict idle pool check and tree
sanity check (`STRICT_CHECK_ENV`: a leak raises in the scheduler). Tail-Replay runs with short
minimum matches and replays (`TAIL_REPLAY_CONFIG`), so short prompts take approximate plans too.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

from eval.fuzz.workload import WorkloadShape
from eval.harness import ServerProcess

CONTEXT = 2048
TAIL_REPLAY_CONFIG = {"min_match_tokens": 16, "min_replay_tokens": 1}
LINEARKV_CONFIG = {"min_chunk_tokens": 8}
#: SGLang's pool checks, on: a leaked KV or state slot raises in the idle scheduler (the server
#: dies), the tree's invariants are checked when idle
STRICT_CHECK_ENV = {"SGLANG_ENABLE_STRICT_MEM_CHECK_DURING_IDLE": "1", "SGLANG_ENABLE_TREE_CACHE_SANITY_CHECK": "1"}
COMMON = ["--dtype", "float32", "--enable-metrics", "--chunked-prefill-size", "64",
          "--context-length", str(CONTEXT), "--mem-fraction-static", "0.3"]


@dataclass(frozen=True)
class FuzzConfig:
    name: str
    arch: str
    backend: str                          # tail_replay | linearkv | stock (SGLang's own hybrid cache)
    strategy: str = "no_buffer"           # --mamba-radix-cache-strategy
    hicache: bool = False
    kv_tokens: int = 2048
    state_slots: int = 16
    extra: tuple[str, ...] = field(default=())

    def args(self) -> list[str]:
        args = [*COMMON, "--mamba-radix-cache-strategy", self.strategy, "--max-total-tokens", str(self.kv_tokens),
                "--max-mamba-cache-size", str(self.state_slots), "--enable-streaming-session"]
        if self.backend != "stock":
            args += ["--radix-cache-backend", self.backend, "--tail-replay-config", json.dumps(TAIL_REPLAY_CONFIG)]
        if self.strategy == "extra_buffer":
            args += ["--mamba-track-interval", "64"]
        if self.backend == "linearkv":
            args += ["--linearkv-config", json.dumps(LINEARKV_CONFIG)]
        if self.hicache:
            args += ["--enable-hierarchical-cache"]
        return args + list(self.extra)

    def shape(self) -> WorkloadShape:
        states = ("predecessor", "zero", "replay-16") + (("compose",) if self.arch == "nemotron-h" else ())
        return WorkloadShape(linearkv=self.backend == "linearkv", max_context=CONTEXT - 600, states=states)

    def server(self, model_path: str, log_path) -> ServerProcess:
        return ServerProcess(model_path, self.args(), log_path=log_path, env=dict(STRICT_CHECK_ENV))


#: (extra_buffer: each running request holds its state and two ping-pong slots, hence more slots;
#: 16 state slots at least: with 8, two concurrent streaming sessions' first turns are never answered
#: on SGLang's own cache too, see benchmarks/README.md, section Exactness fuzzer).
#: `stock-nobuf` is the control: SGLang's own cache under the same workload (every answer must equal
#: the server without cache: the oracles' false-positive check; a hang or leak there is SGLang's)
CONFIGS = {c.name: c for c in (
    FuzzConfig("stock-nobuf", "qwen3-next", "stock"),
    FuzzConfig("tr-nobuf", "qwen3-next", "tail_replay"),
    FuzzConfig("tr-eb", "qwen3-next", "tail_replay", "extra_buffer", state_slots=24),
    FuzzConfig("tr-nobuf-hicache", "qwen3-next", "tail_replay", hicache=True, kv_tokens=1024),
    FuzzConfig("tr-eb-hicache", "qwen3-next", "tail_replay", "extra_buffer", hicache=True, kv_tokens=1024,
               state_slots=24),
    FuzzConfig("lkv-nobuf", "nemotron-h", "linearkv"),
    FuzzConfig("lkv-eb", "qwen3-next", "linearkv", "extra_buffer", state_slots=28),
)}
#: (LinearKV with the host tier is refused at start-up: "--radix-cache-backend linearkv does not run
#: with --enable-hierarchical-cache")


def no_cache_server(model_path: str, log_path) -> ServerProcess:
    """The reference: the same model and numerics, no prefix cache (`--disable-radix-cache`)."""
    return ServerProcess(model_path, [*COMMON, "--disable-radix-cache"], log_path=log_path)
