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
#: `--enable-deterministic-inference` on every server, the reference included: batch-invariant
#: products (`patches/cpu/deterministic.py`) and SGLang's seeded sampler (the `sampled` path)
COMMON = ["--dtype", "float32", "--enable-metrics", "--chunked-prefill-size", "64",
          "--context-length", str(CONTEXT), "--mem-fraction-static", "0.3", "--enable-deterministic-inference"]
#: the pressure configuration's thresholds: pressed whenever another request waits in the queue
PRESSURE = {"num_queue_reqs": 1, "tolerance": 0.05}


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
    #: `exact_unless_pressed` as the server's exactness, with `PRESSURE`'s thresholds
    pressure: bool = False
    #: HiCache's storage tier on SGLang's file backend, and the server restarted halfway through
    #: each seed (the storage directory kept: the second half reads what the first half stored)
    storage: bool = False
    #: the workload's share of long decodes (`WorkloadShape.long_decode_rate`)
    long_decode_rate: float = 0.05
    #: environment variables of the server (name, value)
    env: tuple[tuple[str, str], ...] = field(default=())

    def tail_replay_config(self) -> dict:
        if not self.pressure:
            return dict(TAIL_REPLAY_CONFIG)
        return {**TAIL_REPLAY_CONFIG, "exactness": "exact_unless_pressed", "pressure": dict(PRESSURE)}

    @property
    def pressure_tolerance(self) -> float | None:
        return PRESSURE["tolerance"] if self.pressure else None

    def args(self) -> list[str]:
        args = [*COMMON, "--mamba-radix-cache-strategy", self.strategy, "--max-total-tokens", str(self.kv_tokens),
                "--max-mamba-cache-size", str(self.state_slots), "--enable-streaming-session"]
        if self.backend != "stock":
            args += ["--radix-cache-backend", self.backend, "--tail-replay-config", json.dumps(self.tail_replay_config())]
        if self.strategy == "extra_buffer":
            args += ["--mamba-track-interval", "64"]
        if self.backend == "linearkv":
            args += ["--linearkv-config", json.dumps(LINEARKV_CONFIG)]
        if self.hicache or self.storage:
            args += ["--enable-hierarchical-cache"]
        if self.storage:
            args += ["--hicache-storage-backend", "file", "--hicache-storage-prefetch-policy", "wait_complete"]
        return args + list(self.extra)

    def shape(self) -> WorkloadShape:
        states = ("predecessor", "zero", "replay-16") + (("compose",) if self.arch == "nemotron-h" else ())
        return WorkloadShape(linearkv=self.backend == "linearkv", max_context=CONTEXT - 600,
                             states=states, pressure=self.pressure, long_decode_rate=self.long_decode_rate)

    def server(self, model_path: str, log_path) -> ServerProcess:
        """The server (not started); a storage configuration keeps its files beside the log."""
        env = {**STRICT_CHECK_ENV, **dict(self.env)}
        if self.storage:
            store = log_path.parent / f"{self.name}-storage"
            store.mkdir(parents=True, exist_ok=True)
            env["SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR"] = str(store)
        return ServerProcess(model_path, self.args(), log_path=log_path, env=env)


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
    # SGLang retracts running decodes: its own test switch (every 7th decode step, one request kept;
    # the small KV pool's shortfalls alone rarely force it, SGLang admits decodes conservatively)
    FuzzConfig("tr-retract", "qwen3-next", "tail_replay", kv_tokens=1024, long_decode_rate=0.3,
               env=(("SGLANG_TEST_RETRACT", "1"), ("SGLANG_TEST_RETRACT_INTERVAL", "7"))),
    FuzzConfig("tr-pressure", "qwen3-next", "tail_replay", pressure=True),
    FuzzConfig("tr-l3", "qwen3-next", "tail_replay", storage=True, kv_tokens=1024),
)}
#: (LinearKV with the host tier is refused at start-up: "--radix-cache-backend linearkv does not run
#: with --enable-hierarchical-cache")


def no_cache_server(model_path: str, log_path) -> ServerProcess:
    """The reference: the same model and numerics, no prefix cache (`--disable-radix-cache`)."""
    return ServerProcess(model_path, [*COMMON, "--disable-radix-cache"], log_path=log_path)
