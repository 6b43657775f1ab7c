"""Named server configurations (`--servers`) and the streaming client that replays requests.

A server spec is one string: `[LABEL=]KIND[:JSON] [SGLANG ARGS...]`

* KIND `stock`: SGLang's own (hybrid) radix cache; `tail_replay`: `--radix-cache-backend
  tail_replay`, with `JSON` as its `--tail-replay-config` (default: the backend's defaults);
* SGLANG ARGS: any further `sglang serve` arguments for this server only, shell-quoted
  (e.g. `stock --radix-eviction-policy lfu`);
* LABEL names the server in the report (default: the spec itself, whitespace collapsed).

Examples: `stock`, `tail_replay`, `nockpt=tail_replay:{"keep_checkpoints": false}`,
`"stock --radix-eviction-policy lfu"`.
"""

from __future__ import annotations

import json
import re
import shlex
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import requests

from sglang_ext.tail_replay import BACKEND_NAME

KINDS = ("stock", BACKEND_NAME)
_LABEL = re.compile(r"[A-Za-z0-9_.+-]+")


class ServerSpecError(ValueError):
    """A bad `--servers` entry; the message quotes it."""


@dataclass(frozen=True)
class ServerSpec:
    label: str
    kind: str
    tail_replay_config: dict | None = field(default=None, hash=False)
    extra_args: tuple[str, ...] = ()

    def launch_args(self, common: list[str]) -> list[str]:
        """Arguments after `--model-path`: the shared ones, then this server's own."""
        args = list(common)
        if self.kind == BACKEND_NAME:
            args += ["--radix-cache-backend", BACKEND_NAME]
            if self.tail_replay_config is not None:
                args += ["--tail-replay-config", json.dumps(self.tail_replay_config)]
        return args + list(self.extra_args)


def parse_server_spec(text: str) -> ServerSpec:
    """`[LABEL=]KIND[:JSON] [SGLANG ARGS...]` -> ServerSpec (see the module docstring)."""
    spec = text.strip()
    label = None
    head_end = min([i for i in (spec.find(":"), spec.find(" ")) if i >= 0], default=len(spec))
    eq = spec.find("=")
    if 0 <= eq < head_end:
        label, spec = spec[:eq], spec[eq + 1:].strip()
        if not _LABEL.fullmatch(label):
            raise ServerSpecError(f"--servers {text!r}: label {label!r} may only use letters, digits, _.+-")
    kind_end = min([i for i in (spec.find(":"), spec.find(" ")) if i >= 0], default=len(spec))
    kind, rest = spec[:kind_end], spec[kind_end:]
    if kind not in KINDS:
        raise ServerSpecError(f"--servers {text!r}: unknown kind {kind!r}; use one of {KINDS}")
    config = None
    if rest.startswith(":"):
        if kind != BACKEND_NAME:
            raise ServerSpecError(f"--servers {text!r}: only tail_replay takes a JSON config")
        try:
            config, end = json.JSONDecoder().raw_decode(rest[1:])
        except json.JSONDecodeError as err:
            raise ServerSpecError(f"--servers {text!r}: the config is not valid JSON ({err.msg})") from None
        if not isinstance(config, dict):
            raise ServerSpecError(f"--servers {text!r}: the config must be a JSON object")
        rest = rest[1 + end:]
        if rest and not rest[0].isspace():
            raise ServerSpecError(f"--servers {text!r}: expected a space after the JSON config")
    try:
        extra = tuple(shlex.split(rest))
    except ValueError as err:
        raise ServerSpecError(f"--servers {text!r}: bad quoting in the SGLang arguments ({err})") from None
    if extra and not extra[0].startswith("-"):
        raise ServerSpecError(f"--servers {text!r}: SGLang arguments must start with a flag, got {extra[0]!r}")
    return ServerSpec(label or " ".join(text.split()), kind, config, extra)


def parse_server_specs(texts: list[str]) -> list[ServerSpec]:
    specs = [parse_server_spec(t) for t in texts]
    labels = [s.label for s in specs]
    duplicates = sorted({x for x in labels if labels.count(x) > 1})
    if duplicates:
        raise ServerSpecError(f"--servers: duplicate label(s) {duplicates}; name them with LABEL=...")
    if not specs:
        raise ServerSpecError("--servers: give at least one server")
    return specs


@dataclass(frozen=True)
class Response:
    """One replayed request as the client saw it. `ttft_s`: POST to the first streamed chunk
    (the first output token); `latency_s`: POST to the end of the stream."""

    ok: bool
    ttft_s: float | None
    latency_s: float | None
    meta_info: dict
    output_ids: tuple[int, ...] = ()
    error: str | None = None


def stream_generate(url: str, input_ids: list[int], new_tokens: int, timeout_s: float = 1800.0,
                    custom_params: dict | None = None, session_id: str | None = None,
                    on_accepted: Callable[[], None] | None = None) -> Response:
    """POST /generate with streaming and greedy decoding; never raises for HTTP or protocol
    errors (they come back as `ok=False` with the reason). `custom_params`: sent as
    `sampling_params.custom_params` (e.g. SAE's token_types and session); `session_id`: SGLang's
    top-level session id (its session radix cache reads it); `on_accepted`: called once the server
    has answered the POST with its response headers (the request is in the server's hands), before
    the stream is read."""
    payload = {"input_ids": list(input_ids), "stream": True,
               "sampling_params": {"max_new_tokens": new_tokens, "temperature": 0, "ignore_eos": True}}
    if custom_params:
        payload["sampling_params"]["custom_params"] = custom_params
    if session_id is not None:
        payload["session_id"] = session_id
    t0 = time.perf_counter()
    ttft, last = None, None
    try:
        with requests.post(f"{url}/generate", json=payload, stream=True, timeout=timeout_s) as resp:
            if on_accepted is not None:
                on_accepted()
            if resp.status_code != 200:
                return Response(False, None, None, {}, error=f"HTTP {resp.status_code}: {resp.text[:300]}")
            for line in resp.iter_lines():
                if not line or not line.startswith(b"data:"):
                    continue
                data = line[5:].strip()
                if data == b"[DONE]":
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    return Response(False, None, None, {}, error=f"stream error: {str(chunk['error'])[:300]}")
                if ttft is None:
                    ttft = time.perf_counter() - t0
                last = chunk
    except (requests.RequestException, ValueError) as err:
        return Response(False, None, None, {}, error=f"{type(err).__name__}: {str(err)[:300]}")
    latency = time.perf_counter() - t0
    if last is None:
        return Response(False, None, None, {}, error="empty stream")
    return Response(True, ttft, latency, last.get("meta_info") or {}, tuple(last.get("output_ids") or ()))


def flush_cache(url: str, wait_s: float = 30.0) -> None:
    """Empty the server's cache. SGLang refuses a flush while a request is still in its
    queues, which a just-finished stream can be for a scheduler step: retry until ``wait_s``."""
    deadline = time.monotonic() + wait_s
    while True:
        resp = requests.post(f"{url}/flush_cache", timeout=120)
        if resp.status_code == 200:
            return
        if time.monotonic() >= deadline:
            raise RuntimeError(f"{url}/flush_cache refused ({resp.status_code}) for {wait_s:g} s: "
                               f"{resp.text[:200]}")
        time.sleep(0.2)
