"""Tail-Replay's settings, by who sets them and when, parsed and validated in one place.

- `Knobs` (frozen): how a request is planned, stored and repaired. The server config sets their
  defaults; a client may set each for its own request.
- `ServerConfig` (frozen, at start-up): the knobs' defaults plus the keys only the operator sets
  (`--tail-replay-config '{"budget": 0.05}'`, or `SGLANG_EXT_TAIL_REPLAY_CONFIG`: a JSON object
  or a path to a JSON file). Unknown keys and bad values fail at start-up naming the key.
- `RequestOptions` (frozen, `request_fields.py`): exactly what a client may send
  (`custom_params["tail_replay"]`), checked against the server's config (`RequestOptions.parse`;
  a bad one is a 400 naming it).
- `BackgroundRun` (frozen): the server's mark on a run it sends itself (an audit's reference, a
  repair: `audit_of`, `repair_of`, `repair_kind`), set out of band under `BACKGROUND_PARAM_KEY`
  in the tokenizer process after the request's fields were validated
  (`patches/tail_replay/request.py`); never parsed from a client (a client sending that key or
  one of those fields gets a 400 naming it).
- `TailReplayConfig`: the derived view one request runs with (`resolve`): the server's config,
  the request's effective knobs, its `audit`, the background run it is, and the pressure
  thresholds met at its arrival. Every reader reads this view.

Who may set a key follows from the part that owns it (`KNOB_KEYS`, `SERVER_KEYS`,
`REQUEST_KEYS`). A request's own `audit` / `repair` (and `repair_shared: true`) are refused unless
the server's config sets `allow_request_audit_repair` (each buys an extra exact prefill).

Every reader of the server's config calls `server_config()` (the view of a request that sets
nothing; the variable is read by `sglang_ext.env`, parsed here once per process and value); a
request's options are checked by `check_request` in the tokenizer process and resolved once more
by `request_overrides` in the scheduler when the request is first matched, then kept on its
record (`tail_replay.request`: SGLang sends the request between the two processes as msgspec
data, so no Python object can travel with it). `DEFAULTS` is the default view.
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from sglang_ext.env import tail_replay_config_text
from sglang_ext.tail_replay.decay_profile import (
    PERCENTILES,
    DecayProfile,
    DecayProfileError,
    default_profile_path,
    load_profile,
)
from sglang_ext.tail_replay.pressure import PressurePolicy, parse_policy

if TYPE_CHECKING:
    from sglang_ext.tail_replay.request_fields import RequestOptions

#: `--radix-cache-backend` name of Tail-Replay
BACKEND_NAME = "tail_replay"
KV_MODES = ("exact", "recompute")
#: `exactness`: "approximate" (reuse approximately where that pays), "exact_first" (exact wherever an
#: exact state is on the matched path, approximate only where there is none), "exact" (only exact nodes) or
#: "exact_unless_pressed" ("exact"; under `pressure`, "approximate" within its tolerance)
EXACTNESS = ("approximate", "exact_first", "exact", "exact_unless_pressed")
#: `state_order`: which stored state goes first under state pressure: "lru" (SGLang's order),
#: "ends" (a state its conversation has moved past first, then least recently used) or
#: "approximate_first" (a state that does not count as exact first, then least recently used);
#: "stock_last" (first a state that does not count as exact, then an exact one stock SGLang would no
#: longer hold, then stock's own in stock's LRU order); "auto" (the default): "stock_last" under
#: `exactness` "exact_first" / "exact" / "exact_unless_pressed", "lru" under "approximate"
#: (tail_replay/state_order.py)
STATE_ORDERS = ("auto", "lru", "ends", "approximate_first", "stock_last")
#: `repair_kind` of a repair run: a finished answer's sequence ("answer", `repair: true`) or a shared
#: state's prefix ("shared_state", `repair_shared: true`)
REPAIR_KINDS = ("answer", "shared_state")
#: per-request overrides: `sampling_params.custom_params["tail_replay"] = {"budget": 0.1, ...}`
REQUEST_PARAM_KEY = "tail_replay"
#: `budget: "auto"`: the window certified by the model's decay profile (tail_replay/decay_profile.py)
AUTO = "auto"


class TailReplayConfigError(ValueError):
    pass


def _check(ok: bool, key: str, message: str) -> None:
    if not ok:
        raise TailReplayConfigError(f"tail-replay config key {key!r}: {message}")


@dataclass(frozen=True)
class Knobs:
    """How one request is planned, stored and repaired: the server config sets their defaults, and a
    client may set each of them for its own request (`custom_params["tail_replay"]`), `repair`
    (and `repair_shared: true`) only where the server allows it."""

    #: replay window W as a fraction of the matched length L (W = budget * L, clamped below), or
    #: "auto": the W the model's decay profile certifies for `tolerance` (clamped below)
    budget: float | str = 0.05
    #: W is at least this many tokens ...
    min_replay_tokens: int = 64
    #: ... and at most this many
    max_replay_tokens: int = 4096
    #: matches shorter than this are not reused approximately (full recompute, or an exact checkpoint)
    min_match_tokens: int = 128
    #: also keep SGLang's own exact state checkpoints in the tree (False: the tree holds no states)
    keep_checkpoints: bool = True
    #: "exact": the new tokens attend to the exact cached KV of the whole match;
    #: "recompute": the replayed tail's attention KV is recomputed (approximate) too, and the request
    #: attends to its recomputed tail KV in prefill and decode; the tree keeps its exact KV
    kv_mode: str = "exact"
    #: budget "auto": the replayed state's relative error bound to certify, in (0, 1)
    tolerance: float = 0.01
    #: budget "auto": which per-token decay percentile of the slowest head the bound uses
    decay_percentile: int = 90
    #: "approximate": reuse every cached token, replaying approximately where no exact state is
    #: near; "exact_first": where an exact state is on the matched path, resume from it and
    #: recompute the rest exactly (stock SGLang's hit, served as stock serves it), and replay
    #: approximately only where there is none (where stock misses); "exact": reuse only strictly
    #: exact nodes and states (bound 0), recompute the rest (SGLang's semantics: every output
    #: equals a server without cache); "exact_unless_pressed": "exact", and under the server's
    #: `pressure` "approximate" within its tolerance
    exactness: str = "exact_first"
    #: exact repair (tail_replay/repair.py): when an answer that was not exact finishes, its
    #: sequence (prompt and output) is recomputed exactly in the background, so the tree's nodes
    #: along it and its end state become exact and the conversation's next turn resumes exactly
    repair: bool = False
    #: shared-state repair (tail_replay/repair.py): when a request's matched path ends its states
    #: at one that does not count as exact and that conversations branch from (e.g. the end of a
    #: shared system prompt that an approximate replay reached first), that state is recomputed
    #: exactly in the background, once, so later conversations branching there resume exactly
    repair_shared: bool = True

    def __post_init__(self) -> None:
        if isinstance(self.budget, str):
            _check(self.budget == AUTO, "budget", f"must be a number in [0, 1] or {AUTO!r}, got {self.budget!r}")
        else:
            _check(0.0 <= self.budget <= 1.0, "budget", f"must be in [0, 1] or {AUTO!r}, got {self.budget}")
        _check(0.0 < self.tolerance < 1.0, "tolerance", f"must be in (0, 1), got {self.tolerance}")
        _check(self.decay_percentile in PERCENTILES, "decay_percentile",
               f"must be one of {PERCENTILES}, got {self.decay_percentile!r}")
        _check(self.min_replay_tokens >= 0, "min_replay_tokens", f"must be >= 0, got {self.min_replay_tokens}")
        _check(self.max_replay_tokens >= self.min_replay_tokens, "max_replay_tokens",
               f"must be >= min_replay_tokens ({self.min_replay_tokens}), got {self.max_replay_tokens}")
        _check(self.min_match_tokens >= 0, "min_match_tokens", f"must be >= 0, got {self.min_match_tokens}")
        _check(self.kv_mode in KV_MODES, "kv_mode", f"must be one of {KV_MODES}, got {self.kv_mode!r}")
        _check(self.exactness in EXACTNESS, "exactness", f"must be one of {EXACTNESS}, got {self.exactness!r}")


@dataclass(frozen=True)
class ServerConfig:
    """What the operator sets (`--tail-replay-config`), frozen at start-up: the knobs' defaults and
    the keys only a server sets."""

    #: the defaults of what each request may set for itself
    knobs: Knobs = field(default_factory=Knobs)
    #: the decay profile file (default: decay.json in the model folder, found at start-up)
    decay_profile: str | None = None
    #: a node or state whose bound (tail_replay/provenance/bounds.py) is at most this counts as exact
    #: in the "approximate" mode (float noise of the linear state, relative); 0: only bound 0
    exact_threshold: float = 1e-5
    #: live quality audit (tail_replay/audit.py): the share of approximate answers (provenance not
    #: exact) re-run as an exact prefill in the background, whose next-token distribution is compared
    #: with the served one; 0: off
    audit_rate: float = 0.0
    #: whether a request may set `audit` / `repair` itself (each buys a full-vocabulary
    #: log-softmax or an extra exact prefill); false: such a request gets a 400
    allow_request_audit_repair: bool = False
    #: which stored state is freed first when the state pool is full (one of `STATE_ORDERS`, whose
    #: comment says what each keeps; tail_replay/state_order.py)
    state_order: str = "auto"
    #: "exact_unless_pressed": the load thresholds and tolerance (JSON object; pressure.py)
    pressure: PressurePolicy | None = None
    #: `--enable-unified-memory`: states worth less per byte than KV go before KV under pressure
    #: (byte_budget.py); false: SGLang's own unified-memory eviction (KV first on a state shortfall)
    byte_budget: bool = True
    #: the profile read from `decay_profile` (not a key: filled when the config is parsed)
    profile: DecayProfile | None = field(default=None, compare=False, repr=False)

    def __post_init__(self) -> None:
        _check(0.0 <= self.exact_threshold < 1.0, "exact_threshold",
               f"must be in [0, 1), got {self.exact_threshold}")
        _check(0.0 <= self.audit_rate <= 1.0, "audit_rate", f"must be in [0, 1], got {self.audit_rate}")
        _check(self.state_order in STATE_ORDERS, "state_order", f"must be one of {STATE_ORDERS}, got {self.state_order!r}")
        if self.pressure is not None and not isinstance(self.pressure, PressurePolicy):
            object.__setattr__(self, "pressure", parse_policy(self.pressure, TailReplayConfigError))
        _check(self.knobs.exactness != "exact_unless_pressed" or self.pressure is not None, "exactness",
               "needs the 'pressure' thresholds")


@dataclass(frozen=True)
class BackgroundRun:
    """The server's mark on a run it sends itself (an audit's reference, a repair): set out of band
    in the tokenizer process (`BACKGROUND_PARAM_KEY`), never parsed from a client."""

    #: the rid of the request this run is the audit reference for (never audited itself)
    audit_of: str | None = None
    #: the rid of the request being repaired (never repaired or audited itself)
    repair_of: str | None = None
    #: what a repair run repairs (one of `REPAIR_KINDS`)
    repair_kind: str = "answer"
    #: the knobs the run runs with (exact reuse only, ...), as (name, value) pairs
    knobs: tuple[tuple[str, Any], ...] = ()

    def __post_init__(self) -> None:
        _check(self.repair_kind in REPAIR_KINDS, "repair_kind",
               f"must be one of {REPAIR_KINDS}, got {self.repair_kind!r}")

    @classmethod
    def from_mark(cls, mark: object) -> BackgroundRun:
        """The run from its mark (a JSON object: `audit_of` or `repair_of`, `repair_kind`, and the
        knob values the run needs); TailReplayConfigError naming what is wrong."""
        if not isinstance(mark, dict):
            raise TailReplayConfigError(f"custom_params[{BACKGROUND_PARAM_KEY!r}] must be a JSON object")
        _check(any(mark.get(key) is not None for key in ("audit_of", "repair_of")), BACKGROUND_PARAM_KEY,
               "a background run names the request it is for (audit_of or repair_of)")
        unknown = sorted(set(mark) - set(KNOB_KEYS) - set(BACKGROUND_FIELDS))
        _check(not unknown, BACKGROUND_PARAM_KEY, f"unknown fields {unknown}")
        _check_types({k: v for k, v in mark.items() if k in KNOB_KEYS}, KNOB_KEYS)
        knobs = tuple((k, v) for k, v in mark.items() if k in KNOB_KEYS)
        Knobs(**dict(knobs))   # the values must make valid knobs (their checks name the key)
        return cls(knobs=knobs, **{k: mark[k] for k in BACKGROUND_FIELDS if k in mark})

    def as_mark(self) -> dict:
        """The mark as the tokenizer process puts it in the run's `custom_params`."""
        mark: dict = {"repair_kind": self.repair_kind, **dict(self.knobs)}
        if self.audit_of is not None:
            mark["audit_of"] = self.audit_of
        if self.repair_of is not None:
            mark["repair_of"] = self.repair_of
        return mark


@dataclass(frozen=True)
class TailReplayConfig:
    """The resolved view one request runs with (derived, never parsed): the server's config, its
    knobs after the request's options (or its background run's), the request's own `audit`, the
    background run it is (None for traffic) and the pressure thresholds met at its arrival.
    Made by `resolve`; `server_config()` is the view of a request that sets nothing."""

    server: ServerConfig = field(default_factory=ServerConfig)
    knobs: Knobs = field(default_factory=Knobs)
    audit: bool = False
    run: BackgroundRun | None = None
    #: the thresholds the request's pressure stamp says were met at its arrival (out of band)
    pressed_by: tuple[str, ...] = ()

    @property
    def strict(self) -> bool:
        """`exactness: "exact"` (or "exact_unless_pressed" not pressed): only strictly exact nodes
        and states are reused."""
        exactness = self.knobs.exactness
        return exactness == "exact" or (exactness == "exact_unless_pressed" and not self.pressed_by)

    @property
    def exact_first(self) -> bool:
        """`exactness: "exact_first"`: an exact state on the matched path is always taken."""
        return self.knobs.exactness == "exact_first"

    @property
    def background(self) -> bool:
        """A run the server sent itself (an audit's reference, a repair): not traffic."""
        return self.run is not None

    @property
    def audit_of(self) -> str | None:
        return None if self.run is None else self.run.audit_of

    @property
    def repair_of(self) -> str | None:
        return None if self.run is None else self.run.repair_of

    @property
    def repair_kind(self) -> str | None:
        return None if self.run is None else self.run.repair_kind

    @property
    def threshold(self) -> float:
        """The bound up to which a node counts as exact for this config (0 in the exact mode)."""
        return 0.0 if self.strict else self.server.exact_threshold

    def replaced(self, **settings: Any) -> TailReplayConfig:
        """The same view with some settings otherwise (checked), each to the part that owns it: a
        knob changes what this request runs with, a server key the server config it sees."""
        _check_known(settings, BACKGROUND_FIELDS)
        knobs = {k: v for k, v in settings.items() if k in KNOB_KEYS}
        server = {k: v for k, v in settings.items() if k in SERVER_KEYS + ("profile",)}
        view = replace(self, knobs=replace(self.knobs, **knobs)) if knobs else self
        view = replace(view, server=replace(view.server, **server)) if server else view
        if "audit" in settings or "pressed_by" in settings:
            view = replace(view, audit=bool(settings.get("audit", view.audit)),
                           pressed_by=tuple(settings.get("pressed_by", view.pressed_by)))
        marks = {k: v for k, v in settings.items() if k in BACKGROUND_FIELDS}
        if marks:
            view = replace(view, run=replace(view.run or BackgroundRun(), **marks))
        return view

    @classmethod
    def of(cls, **settings: Any) -> TailReplayConfig:
        """A view from flat settings (Python callers and tests): each key goes to the part that owns
        it (knobs, server keys, `audit`, the background run's fields, `pressed_by`)."""
        _check_known(settings, BACKGROUND_FIELDS)
        knobs = Knobs(**{k: v for k, v in settings.items() if k in KNOB_KEYS})
        server = ServerConfig(knobs=knobs, **{k: v for k, v in settings.items() if k in SERVER_KEYS + ("profile",)})
        marks = {k: v for k, v in settings.items() if k in BACKGROUND_FIELDS}
        run = BackgroundRun(**marks) if any(marks.get(k) is not None for k in ("audit_of", "repair_of")) else None
        return cls(server=server, knobs=knobs, audit=bool(settings.get("audit", False)), run=run,
                   pressed_by=tuple(settings.get("pressed_by", ())))


def resolve(server: ServerConfig, options: RequestOptions | None = None,
            run: BackgroundRun | None = None, pressed_by: tuple[str, ...] = ()) -> TailReplayConfig:
    """The view a request runs with: the server's knobs, then its options, then its background
    run's knobs (a run's own values win: it is exact whatever its origin asked)."""
    knobs = server.knobs if options is None else options.applied_to(server.knobs)
    if run is not None and run.knobs:
        knobs = replace(knobs, **dict(run.knobs))
    return TailReplayConfig(server=server, knobs=knobs, audit=options is not None and options.audit,
                            run=run, pressed_by=pressed_by)


def _field_names(cls: type) -> tuple[str, ...]:
    return tuple(f.name for f in fields(cls))


#: the keys of each part (the config's and a request's legality follow from who owns a key)
KNOB_KEYS = _field_names(Knobs)
SERVER_KEYS = tuple(k for k in _field_names(ServerConfig) if k not in ("knobs", "profile"))
REQUEST_KEYS = KNOB_KEYS + ("audit",)
#: the server's marks on its own background runs: set out of band (`BACKGROUND_PARAM_KEY`), never
#: by a client or a server config
BACKGROUND_FIELDS = ("audit_of", "repair_of", "repair_kind")
#: `custom_params` key of the server's mark on its own background runs (`BackgroundRun.as_mark`);
#: refused from a client, set in the tokenizer process after the request's fields were validated
#: (patches/tail_replay/request.py)
BACKGROUND_PARAM_KEY = "tail_replay_background"
#: the server config knob that allows a request's `audit` / `repair` (and `repair_shared: true`)
ALLOW_KNOB = "allow_request_audit_repair"

_TYPES: dict[str, type | tuple[type, ...]] = {
    "budget": (int, float, str), "min_replay_tokens": int, "max_replay_tokens": int,
    "min_match_tokens": int, "keep_checkpoints": bool, "kv_mode": str,
    "tolerance": (int, float), "decay_percentile": int, "decay_profile": str,
    "exactness": str, "exact_threshold": (int, float), "audit_rate": (int, float), "audit": bool,
    "state_order": str, "repair": bool, "repair_shared": bool, "allow_request_audit_repair": bool,
    "byte_budget": bool,
    "pressure": dict}


def _check_known(settings: dict, more: tuple[str, ...] = ()) -> None:
    unknown = sorted(set(settings) - set(KNOB_KEYS) - set(SERVER_KEYS) - {"audit", "pressed_by", "profile"} - set(more))
    _check(not unknown, ", ".join(unknown), "unknown key")


def _check_types(raw: dict, known: tuple[str, ...]) -> None:
    for key, value in raw.items():
        _check(key in known, key, f"unknown key; known keys: {sorted(known)}")
        expected = _TYPES[key]
        wrong_bool = isinstance(value, bool) and expected is not bool
        _check(isinstance(value, expected) and not wrong_bool, key, f"has the wrong type ({value!r})")


#: the defaults (what a server without `--tail-replay-config` runs with, for a request that sets
#: nothing)
DEFAULTS = TailReplayConfig()


def server_from_dict(raw: dict) -> ServerConfig:
    """The server's config from its JSON object (knob defaults and server keys)."""
    for key in BACKGROUND_FIELDS:
        _check(key not in raw, key, "is set by the server on its own background runs; a server config cannot set it")
    _check("audit" not in raw, "audit", "is a per-request key; a server config cannot set it")
    _check_types(raw, KNOB_KEYS + SERVER_KEYS)
    server = ServerConfig(knobs=Knobs(**{k: v for k, v in raw.items() if k in KNOB_KEYS}),
                          **{k: v for k, v in raw.items() if k in SERVER_KEYS})
    if server.decay_profile is None:
        return server
    try:
        return replace(server, profile=load_profile(server.decay_profile))
    except DecayProfileError as exc:
        raise TailReplayConfigError(f"tail-replay config key 'decay_profile': {exc}") from None


def config_from_dict(raw: dict) -> TailReplayConfig:
    """The view of a request that sets nothing, on the server configured by `raw`."""
    return resolve(server_from_dict(raw))


def user_settings(config: TailReplayConfig | ServerConfig) -> dict:
    """The server config's keys and values as a user writes them (knob defaults and server keys;
    no derived fields, no request options)."""
    server = config.server if isinstance(config, TailReplayConfig) else config
    settings: dict = {name: getattr(server.knobs, name) for name in KNOB_KEYS}
    for name in SERVER_KEYS:
        value = getattr(server, name)
        settings[name] = value.as_dict() if isinstance(value, PressurePolicy) else value
    return settings


@functools.lru_cache(maxsize=4)
def _parsed(text: str | None) -> TailReplayConfig:
    return parse_config(text)


def server_config() -> TailReplayConfig:
    """The server's config (`SGLANG_EXT_TAIL_REPLAY_CONFIG`), parsed once per process and value of
    the variable (requests call this: no JSON or file read per request); TailReplayConfigError
    naming the key when it is bad."""
    return _parsed(tail_replay_config_text())


def parse_config(text: str | None) -> TailReplayConfig:
    """Parse a JSON object, or the path of a JSON file; None or '' gives the defaults."""
    if not text:
        return DEFAULTS
    source = text
    if not text.lstrip().startswith("{"):
        path = Path(text)
        if not path.is_file():
            raise TailReplayConfigError(f"tail-replay config {text!r} is neither a JSON object nor a file")
        source = path.read_text()
    try:
        raw = json.loads(source)
    except json.JSONDecodeError as exc:
        raise TailReplayConfigError(f"tail-replay config is not valid JSON: {exc}") from None
    if not isinstance(raw, dict):
        raise TailReplayConfigError("tail-replay config must be a JSON object")
    return config_from_dict(raw)


def with_model_profile(text: str | None, model_path: str) -> str | None:
    """The config text, plus `decay_profile` = the model folder's decay.json when the config names
    none and the folder has one (so `budget: "auto"` works, also per request); else `text`."""
    config = parse_config(text)
    path = default_profile_path(model_path) if config.server.decay_profile is None else None
    if path is None:
        return text
    settings = {k: v for k, v in user_settings(config).items() if v is not None}
    return json.dumps({**settings, "decay_profile": path})

