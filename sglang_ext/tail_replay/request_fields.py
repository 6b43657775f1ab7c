"""The fields a client's request may set, checked once on arrival (tokenizer process) and read
once by the scheduler: `check_request` (a bad field is a TailReplayConfigError naming it, which
SGLang answers with HTTP 400), `request_overrides` (the config a request runs with, the server's
own out-of-band mark on its background runs included), `background_mark` (that mark), and the
refusals a server decides at start-up (`RequestLimits`). Pure: no SGLang import. The server's
config itself, its keys and their checks live in `config.py`."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from sglang_ext.tail_replay.config import (
    ALLOW_KNOB,
    AUTO,
    BACKGROUND_FIELDS,
    BACKGROUND_PARAM_KEY,
    REQUEST_KEYS,
    REQUEST_PARAM_KEY,
    SERVER_KEYS,
    BackgroundRun,
    Knobs,
    ServerConfig,
    TailReplayConfig,
    TailReplayConfigError,
    _check,
    _check_types,
)
from sglang_ext.tail_replay.pressure import PRESSURE_PARAM_KEY

#: how the fields a request can set are named in errors
CUSTOM_PARAMS_FIELD = "sampling_params.custom_params"
OVERRIDES_FIELD = f"{CUSTOM_PARAMS_FIELD}[{REQUEST_PARAM_KEY!r}]"


@dataclass(frozen=True)
class RequestOptions:
    """Exactly what a client may send for its request (`custom_params["tail_replay"]`), checked
    against the server's config on arrival (`RequestOptions.parse`)."""

    #: the knobs it sets, as (name, value) pairs
    knobs: tuple[tuple[str, Any], ...] = ()
    #: audit this request whatever it was (exact or not); only on a server with
    #: `allow_request_audit_repair`
    audit: bool = False

    @classmethod
    def parse(cls, raw: object, server: ServerConfig) -> RequestOptions:
        """A client's `custom_params["tail_replay"]` object; TailReplayConfigError naming the key
        when it is not a request option, has the wrong type or is refused on this server."""
        if raw is None:
            return cls()
        if not isinstance(raw, dict):
            raise TailReplayConfigError(f"custom_params[{REQUEST_PARAM_KEY!r}] must be a JSON object")
        for key in BACKGROUND_FIELDS:
            _check(key not in raw, key, "is set by the server on its own background runs; a request cannot set it")
        for key in raw:
            _check(key not in SERVER_KEYS, key, "is a server setting; a request cannot set it")
        _check_types(raw, REQUEST_KEYS)
        allowed = server.allow_request_audit_repair
        for key in ("audit", "repair"):
            _check(key not in raw or allowed, key,
                   f"is refused on this server: per-request audit and repair are off (server config key "
                   f"{ALLOW_KNOB!r} is false)")
        _check(raw.get("repair_shared") is not True or allowed, "repair_shared",
               f"true is refused on this server: per-request audit and repair are off (server config key "
               f"{ALLOW_KNOB!r} is false); a request may only set it to false")
        options = cls(knobs=tuple((k, v) for k, v in raw.items() if k != "audit"), audit=bool(raw.get("audit", False)))
        knobs = options.applied_to(server.knobs)
        _check(knobs.budget != AUTO or server.profile is not None, "budget",
               f"{AUTO!r} needs the model's decay profile, and this server has none")
        _check(knobs.exactness != "exact_unless_pressed" or server.pressure is not None, "exactness",
               "needs the 'pressure' thresholds")
        return options

    def applied_to(self, defaults: Knobs) -> Knobs:
        return replace(defaults, **dict(self.knobs)) if self.knobs else defaults



def with_overrides(base: TailReplayConfig, overrides: object) -> TailReplayConfig:
    """`base` with a request's options applied (`RequestOptions.parse`); raises
    TailReplayConfigError naming the key."""
    if overrides is None:
        return base
    options = RequestOptions.parse(overrides, base.server)
    return replace(base, knobs=options.applied_to(base.knobs), audit=options.audit)


@dataclass(frozen=True)
class RequestLimits:
    """Override values a server refuses, decided once at start-up from its config and flags
    (see `tail_replay.startup.request_limits`). Each field: None (allowed) or the reason."""
    #: why `keep_checkpoints: true` is refused (the state pool has no slot for a checkpoint)
    checkpoints_refused: str | None = None
    #: why `kv_mode: "exact"` is refused (a quantized KV cache)
    exact_kv_refused: str | None = None


def check_request(base: TailReplayConfig, custom_params: object,
                  limits: RequestLimits = RequestLimits()) -> TailReplayConfig:
    """The check of a client's request on arrival (tokenizer process), and the config it asks for:
    `base` plus `custom_params["tail_replay"]`.

    Every field the extension reads from a request is checked here; a bad one raises
    TailReplayConfigError (a ValueError: SGLang answers that request with HTTP 400) whose message
    names the field, so no malformed request reaches the scheduler. The server's own mark
    (`BACKGROUND_PARAM_KEY`) is refused here: only the server sets it, after this check."""
    for key, when in ((BACKGROUND_PARAM_KEY, "on its own background runs"), (PRESSURE_PARAM_KEY, "at arrival")):
        if isinstance(custom_params, dict) and key in custom_params:   # the server's marks (pressure.py)
            raise TailReplayConfigError(f"{CUSTOM_PARAMS_FIELD}[{key!r}] is set by the server {when}; a request cannot set it")
    return _with_request_fields(base, custom_params, limits)


def request_overrides(base: TailReplayConfig, custom_params: object,
                      limits: RequestLimits = RequestLimits()) -> TailReplayConfig:
    """The config a request runs with (scheduler, at its first match): `base` plus its
    `custom_params["tail_replay"]` (checked on arrival by `check_request`) and, on the server's own
    background runs, the server's mark (`BACKGROUND_PARAM_KEY`: which reaches the scheduler only
    from the tokenizer process, which sets it after `check_request` refused it from clients)."""
    mark = custom_params.get(BACKGROUND_PARAM_KEY) if isinstance(custom_params, dict) else None
    if mark is None:
        return _with_request_fields(base, custom_params, limits)
    assert isinstance(custom_params, dict)
    client = {key: value for key, value in custom_params.items() if key != BACKGROUND_PARAM_KEY}
    config = _with_request_fields(base, client, limits)
    run = BackgroundRun.from_mark(mark)
    return replace(config, run=run, knobs=replace(config.knobs, **dict(run.knobs)))


def _with_request_fields(base: TailReplayConfig, custom_params: object, limits: RequestLimits) -> TailReplayConfig:
    if custom_params is None:
        return base
    if not isinstance(custom_params, dict):
        raise TailReplayConfigError(
            f"{CUSTOM_PARAMS_FIELD} must be a JSON object, got {type(custom_params).__name__} {custom_params!r:.60}")
    overrides = custom_params.get(REQUEST_PARAM_KEY)
    if overrides is None:
        return base
    if not isinstance(overrides, dict):
        raise TailReplayConfigError(
            f"{OVERRIDES_FIELD} must be a JSON object, got {type(overrides).__name__} {overrides!r:.60}")
    try:
        config = with_overrides(base, overrides)
    except TailReplayConfigError as exc:
        raise TailReplayConfigError(f"{OVERRIDES_FIELD}: {exc}") from None
    if overrides.get("keep_checkpoints") is True and limits.checkpoints_refused:
        raise TailReplayConfigError(f"{OVERRIDES_FIELD}: key 'keep_checkpoints': true is refused on this "
                                    f"server: {limits.checkpoints_refused}")
    if overrides.get("kv_mode") == "exact" and limits.exact_kv_refused:
        raise TailReplayConfigError(f"{OVERRIDES_FIELD}: key 'kv_mode': 'exact' is refused on this "
                                    f"server: {limits.exact_kv_refused}")
    return config


def background_mark(mark: dict) -> dict:
    """The mark the server puts on its own background run (`BACKGROUND_PARAM_KEY`): checked where it
    is made (a wrong one raises TailReplayConfigError naming it: `BackgroundRun.from_mark`) and again
    in the scheduler."""
    return BackgroundRun.from_mark(mark).as_mark()
