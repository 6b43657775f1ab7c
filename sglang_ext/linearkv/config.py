"""LinearKV's server configuration (pure core: no SGLang import): `--linearkv-config`, the
selector and state-rule vocabulary a request may also use, the start-up refusals of server flags,
and the radix-tree namespaces chunks are registered under."""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any

#: `--radix-cache-backend linearkv`
BACKEND_NAME = "linearkv"
#: key of the per-request summary in `meta_info["cached_tokens_details"]` and in custom_params
META_KEY = "linearkv"
#: state rules served by the server (the reference path also has packed variants); `compose` (exact
#: composition of the chunks' end states through their transitions) on Mamba-2 models only;
#: `replay` (or `replay-<r>`): KV-only, each recomputed span starts `r` tokens earlier from a zero
#: state, in context (Tail-Replay's idea applied to chunks), so no chunk state is read
SERVED_STATE_RULES = ("predecessor", "zero", "compose", "replay")
#: state rules that read no chunk state: their registrations keep only the chunks' KV
KV_ONLY_RULES = ("zero", "replay")
#: tokens replayed by state rule `replay` without a `-<r>`
DEFAULT_REPLAY_TOKENS = 64
#: state rules that need each chunk's transition (a per-head scalar decay on Mamba-2)
COMPOSING_RULES = ("compose",)
#: selector kinds served by the server: `none` (only the question is computed) and `epic`
#: (EPIC / LegoLink-k: also the first k tokens of every chunk, in context); the reference path
#: also has `cacheblend-r`
SERVED_SELECTORS = ("none", "epic")
#: EPIC's k when the selector is "epic" and no `k` is given
DEFAULT_EPIC_K = 16
#: radix-tree namespace (`extra_key`) of registered chunks, per model, then per tenant (see
#: `tenant_namespace`); KV events leave it out
NAMESPACE_PREFIX = "linearkv-chunk:"
#: `--mamba-radix-cache-strategy` values LinearKV serves (`auto` before SGLang resolves it; it
#: resolves to one of the first two). Under `extra_buffer` a registration keeps its end state at the
#: chunk's end, not on the tracking grid (`mamba_component.LinearKVMambaComponent`).
SERVED_STRATEGIES = ("no_buffer", "extra_buffer", "auto", None)

#: `exact_requests`: what a request with chunks that asks `exactness: "exact"` gets (assembled chunk KV
#: is context-free, never exact): "prefill" (served as a plain prefill of its whole prompt, exact,
#: its chunks counted missed) or "refuse" (HTTP 400 saying why)
EXACT_REQUEST_MODES = ("prefill", "refuse")

_CONFIG_KEYS = ("selector", "k", "state", "min_chunk_tokens", "separator", "exact_requests")
CONFIG_WHERE = "--linearkv-config key '{}'"


class LinearKVConfigError(ValueError):
    """A bad `--linearkv-config` (names the key)."""


@dataclass(frozen=True)
class LinearKVConfig:
    """`--linearkv-config` JSON.

    selector: which chunk tokens are recomputed in context: "none" (only the question), "epic"
        (EPIC-k: also the first k tokens of every chunk, in context, each chunk's head seeded by the
        state rule from the chunks before it) or "epic-<k>"; parsed to "none" or "epic-<k>".
    k: EPIC's k for selector "epic" (default 16), also for requests that ask for "epic".
    state: the linear layers' seed for the question ("predecessor" | "zero" | "compose"; compose:
        Mamba-2 models only, the exact composition of the chunks' zero-start end states through
        their decays exp(A sum dt), captured at registration, from P's state taken as zero).
    min_chunk_tokens: a declared chunk shorter than this is joined to the span after it (a chunk
        costs one cached state; tiny ones are not worth it).
    separator: server-wide separator string for text prompts (None: only per request).
    exact_requests: a request with chunks whose exactness is strict (`exactness: "exact"`, or
        "exact_unless_pressed" not pressed; its own `custom_params.tail_replay` or the server's
        `--tail-replay-config`): "prefill" (its whole prompt is prefilled as sent, exact) or
        "refuse" (a request naming chunk spans gets HTTP 400; in separator mode the text is then
        never split, so it is a plain prompt). Assembly is never exact, whatever this says.
    """

    selector: str = "none"
    k: int | None = None
    state: str = "predecessor"
    min_chunk_tokens: int = 16
    separator: str | None = None
    exact_requests: str = "prefill"


def parse_config(text: str | Mapping[str, Any] | None) -> LinearKVConfig:
    """Parse and validate; raise LinearKVConfigError naming the key."""
    if text is None or text == "":
        return LinearKVConfig()
    raw = _load_json(text) if isinstance(text, str) else dict(text)
    if not isinstance(raw, dict):
        raise LinearKVConfigError("--linearkv-config must be a JSON object")
    unknown = sorted(set(raw) - set(_CONFIG_KEYS))
    if unknown:
        raise LinearKVConfigError(f"--linearkv-config: unknown key {unknown[0]!r}; known keys: {list(_CONFIG_KEYS)}")
    config = LinearKVConfig(**raw)
    k = epic_k(config.selector, config.k, CONFIG_WHERE, LinearKVConfigError)
    config = replace(config, selector=selector_name(k), k=config.k if config.k is not None else (k or None))
    check_state(config.state, "--linearkv-config key 'state'", LinearKVConfigError)
    n = config.min_chunk_tokens
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise LinearKVConfigError(f"--linearkv-config key 'min_chunk_tokens' must be an integer >= 1, got {n!r}")
    if config.separator is not None and (not isinstance(config.separator, str) or not config.separator):
        raise LinearKVConfigError(
            f"--linearkv-config key 'separator' must be a non-empty string, got {config.separator!r}")
    if config.exact_requests not in EXACT_REQUEST_MODES:
        raise LinearKVConfigError(f"--linearkv-config key 'exact_requests' must be one of {list(EXACT_REQUEST_MODES)}, "
                                  f"got {config.exact_requests!r}")
    return config


def _load_json(text: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise LinearKVConfigError(f"--linearkv-config is not valid JSON: {exc}") from None


def epic_k(selector: Any, k: Any, where: str, error: type[ValueError]) -> int:
    """EPIC's k of a served selector ("none" -> 0; "epic" -> k, or DEFAULT_EPIC_K; "epic-<k>").
    `where` names a key when formatted with it ("--linearkv-config key '{}'"); `error` is raised."""
    if k is not None and (isinstance(k, bool) or not isinstance(k, int) or k < 0):
        raise error(f"{where.format('k')} must be an integer >= 0, got {k!r}")
    if selector == "none":
        return 0
    if selector == "epic":
        return DEFAULT_EPIC_K if k is None else k
    kind, _, arg = selector.partition("-") if isinstance(selector, str) else ("", "", "")
    if kind == "epic" and arg.isdigit():
        if k is not None and k != int(arg):
            raise error(f"{where.format('k')} = {k} contradicts selector {selector!r}")
        return int(arg)
    if kind == "cacheblend":
        raise error(f"{where.format('selector')}: {selector!r} is not served: CacheBlend picks its tokens by "
                    "KV deviation at the first attention layer, inside one forward over every chunk token, "
                    "which SGLang's layer loop does not expose; it runs on the reference path "
                    "(sglang_ext.linearkv.reference). Served: none, epic, epic-<k>")
    raise error(f"{where.format('selector')}: {selector!r} is not a selector; served: none, epic, epic-<k>")


def selector_name(k: int) -> str:
    return f"epic-{k}" if k else "none"


def state_rule(value: str) -> tuple[str, int]:
    """(served rule, tokens replayed) of a state value: "replay" -> ("replay", 64),
    "replay-<r>" -> ("replay", r), any other -> (value, 0). Unchecked."""
    if value == "replay":
        return "replay", DEFAULT_REPLAY_TOKENS
    kind, _, arg = value.partition("-") if isinstance(value, str) else ("", "", "")
    if kind == "replay" and arg.isdigit() and int(arg) > 0:
        return "replay", int(arg)
    return value, 0



def check_state(value: Any, where: str, error: type[ValueError]) -> None:
    if not isinstance(value, str) or state_rule(value)[0] not in SERVED_STATE_RULES:
        raise error(f"{where}: {value!r} is not served; choose from {list(SERVED_STATE_RULES)} or replay-<r> "
                    "(r >= 1 tokens; packed rules run on the reference path)")


def check_server_flags(server_args: Any) -> None:
    """Start-up refusals for `--radix-cache-backend linearkv` (ValueError naming the flag); other
    backends pass."""
    if getattr(server_args, "radix_cache_backend", None) != BACKEND_NAME:
        return
    page_size = getattr(server_args, "page_size", None) or 1
    if page_size != 1:
        raise ValueError("--radix-cache-backend linearkv needs --page-size 1 (a chunk is reused only in full, "
                         f"and a page-aligned tree would cut its last page); got --page-size {page_size}")
    strategy = getattr(server_args, "mamba_radix_cache_strategy", None)
    if strategy not in SERVED_STRATEGIES:
        raise ValueError(f"--radix-cache-backend linearkv runs with --mamba-radix-cache-strategy "
                         f"{' / '.join(SERVED_STRATEGIES[:2])} (or auto, which SGLang resolves to one of them); "
                         f"got --mamba-radix-cache-strategy {strategy} (the lazy variant may skip a checkpoint "
                         "when its pre-allocation fails, and a chunk registration must keep its end state)")
    if getattr(server_args, "enable_hierarchical_cache", False):
        raise ValueError("--radix-cache-backend linearkv does not run with --enable-hierarchical-cache")
    if getattr(server_args, "enable_dp_attention", False):
        raise ValueError("--radix-cache-backend linearkv does not run with --enable-dp-attention (EPIC's "
                         "pre-pass forwards run on one rank's requests only)")
    if getattr(server_args, "enable_watermark", False):
        raise ValueError("--radix-cache-backend linearkv does not run with --enable-watermark (EPIC's pre-pass "
                         "forwards carry no sampling state)")


def namespace(model_id: str) -> str:
    """The radix-tree `extra_key` prefix under which a model's chunks are registered."""
    return NAMESPACE_PREFIX + model_id


def tenant_namespace(model_namespace: str, extra_key: str | None) -> str:
    """The `extra_key` of the chunks of a request whose own `extra_key` (SGLang's: the client's
    `extra_key` with its LoRA id appended) is `extra_key`: chunks are registered per tenant, as
    SGLang's own prefix cache keys prompts (the cache salt is kept apart, in the key's
    `cache_salt`). A registration sent with `extra_key = tenant_namespace(ns, client_key)` and the
    request's LoRA gets `tenant_namespace(ns, client_key + lora_id)` from SGLang, the key its
    request looks chunks up under."""
    return f"{model_namespace}|{extra_key or ''}"


def is_chunk_namespace(extra_key: str | None) -> bool:
    """Whether a radix key's `extra_key` is a chunk namespace (never a prompt's)."""
    return extra_key is not None and extra_key.startswith(NAMESPACE_PREFIX)
