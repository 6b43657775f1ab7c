"""HTTP clients for the servers a run talks to, and launching patched servers for a model."""

from __future__ import annotations

import contextlib
import json
import shlex
import time
from dataclasses import dataclass
from pathlib import Path

import requests

from eval.quality.configs import TAIL_REPLAY
from sglang_ext.tail_replay import BACKEND_NAME, REQUEST_PARAM_KEY, TailReplayConfig, parse_config, with_model_profile

#: Tail-Replay server: no exact state checkpoints, so every hit is rebuilt from the tail alone
TAIL_REPLAY_SERVER_CONFIG = {"keep_checkpoints": False}


def tail_replay_server_config(model_path: str | None) -> TailReplayConfig:
    """The config a Tail-Replay server launched with TAIL_REPLAY_SERVER_CONFIG on `model_path`
    runs under: as the server resolves it at start-up (`with_model_profile`: plus the model
    folder's decay.json when it has one, so `budget: "auto"` requests can be planned here too)."""
    text = json.dumps(TAIL_REPLAY_SERVER_CONFIG)
    return parse_config(with_model_profile(text, model_path) if model_path else text)
DEFAULT_LAUNCH_ARGS = "--dtype float32"


class ServerUnreachable(RuntimeError):
    pass


@dataclass(frozen=True)
class Client:
    url: str
    timeout_s: float = 1800.0

    def _post(self, path: str, payload: dict | None = None) -> requests.Response:
        try:
            return requests.post(f"{self.url}{path}", json=payload, timeout=self.timeout_s)
        except requests.ConnectionError as err:
            raise ServerUnreachable(f"cannot reach the server at {self.url} ({type(err).__name__})") from None

    def check(self) -> None:
        try:
            requests.get(f"{self.url}/health", timeout=30).raise_for_status()
        except requests.RequestException as err:
            raise ServerUnreachable(f"cannot reach the server at {self.url}: {type(err).__name__}") from None

    def flush(self, attempts: int = 50, wait_s: float = 0.1) -> None:
        """Empty the server's cache. SGLang refuses while a request is still leaving its running
        batch (a response can arrive before the scheduler is idle), so a refusal is retried."""
        for _ in range(attempts):
            resp = self._post("/flush_cache")
            if resp.status_code == 200:
                return
            time.sleep(wait_s)
        raise RuntimeError(f"{self.url}/flush_cache refused {attempts} times ({resp.status_code}): {resp.text[:200]}")

    def tokenize(self, text: str) -> list[int]:
        """The token ids the server makes of `text` (SGLang's `/tokenize`, as `/generate` tokenizes)."""
        resp = self._post("/tokenize", {"prompt": text})
        if resp.status_code != 200:
            raise RuntimeError(f"{self.url}/tokenize failed ({resp.status_code}): {resp.text[:300]}")
        return [int(t) for t in resp.json()["tokens"]]

    def server_info(self) -> dict:
        """SGLang's `/server_info` (the resolved server arguments)."""
        try:
            resp = requests.get(f"{self.url}/server_info", timeout=30)
        except requests.ConnectionError as err:
            raise ServerUnreachable(f"cannot reach the server at {self.url} ({type(err).__name__})") from None
        resp.raise_for_status()
        return resp.json()

    def page_size(self) -> int:
        """The server's KV page size (`/server_info`)."""
        return int(self.server_info().get("page_size") or 1)

    def tail_replay_config(self) -> TailReplayConfig:
        """The Tail-Replay config this server (launched with TAIL_REPLAY_SERVER_CONFIG) plans
        with: its `--model-path` from `/server_info` decides whether a decay profile is known."""
        return tail_replay_server_config(self.server_info().get("model_path"))

    def generate(self, prompt: str, max_new_tokens: int, overrides: dict | None = None) -> dict:
        params = {"max_new_tokens": max_new_tokens, "temperature": 0}
        if overrides:
            params["custom_params"] = {REQUEST_PARAM_KEY: overrides}
        resp = self._post("/generate", {"text": prompt, "sampling_params": params, "return_logprob": True})
        if resp.status_code != 200:
            raise RuntimeError(f"{self.url}/generate failed ({resp.status_code}): {resp.text[:300]}")
        return resp.json()

    def generate_ids(self, input_ids: list[int], max_new_tokens: int, overrides: dict | None = None,
                     logprob_start_len: int | None = None) -> dict:
        """`/generate` on token ids; with `logprob_start_len`, the input tokens' log-probabilities
        from that position on come back in `meta_info.input_token_logprobs`."""
        params: dict = {"max_new_tokens": max_new_tokens, "temperature": 0}
        if overrides:
            params["custom_params"] = {"tail_replay": overrides}
        body: dict = {"input_ids": input_ids, "sampling_params": params}
        if logprob_start_len is not None:
            body.update(return_logprob=True, logprob_start_len=logprob_start_len)
        resp = self._post("/generate", body)
        if resp.status_code != 200:
            raise RuntimeError(f"{self.url}/generate failed ({resp.status_code}): {resp.text[:300]}")
        return resp.json()


def server_args(kind: str, launch_args: str) -> list[str]:
    args = shlex.split(launch_args)
    if kind == TAIL_REPLAY:
        args += ["--radix-cache-backend", BACKEND_NAME, "--tail-replay-config", json.dumps(TAIL_REPLAY_SERVER_CONFIG)]
    return args


@contextlib.contextmanager
def launched(model: str, kinds: list[str], launch_args: str, log_dir: Path):
    """Start one patched server per kind (STOCK / TAIL_REPLAY) on `model`; yield kind -> Client.
    The servers are stopped on exit, also when the run is ended by SIGTERM."""
    from eval.harness import ServerProcess, servers_running

    log_dir.mkdir(parents=True, exist_ok=True)
    procs = {k: ServerProcess(model, server_args(k, launch_args), log_path=log_dir / f"server-{k}.log") for k in kinds}
    with servers_running(list(procs.values())):
        yield {k: Client(p.url) for k, p in procs.items()}

