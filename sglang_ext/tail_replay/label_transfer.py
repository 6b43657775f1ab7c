"""PD disaggregation: the prefill server's answer label, carried to the decode server in one row
of SGLang's transferred metadata (pure: no SGLang or torch import).

Under prefill-decode disaggregation the prefill server computes the prompt (its plan, its record)
and the decode server, which answers, has no record of it. So the prefill server encodes the label
`metrics.answer_label` gives its request (the first output's: the state the decode side continues
from, and what it read) into a row of 64-bit words (`encode_label`), which travels with the
first token's metadata (`patches/tail_replay/disagg.py`: one more buffer of SGLang's
`MetadataBuffers`, which every transfer engine copies byte for byte), and the decode server reads
it back (`decode_label`) and keeps it in its record (`TailReplayRequest.carried_label`): the tokens
it generates carry the bound of the state they continue from (bounds do not grow), so the decode
side's answer is labelled as the prefill side labelled it.

The row (`ROW_WORDS` int64 words): a magic word and a version (a row of zeros, or a stock
prefill's, is not ours), the request's bootstrap room (a row left by another request is not this
one's), the label's fields (floats as their IEEE-754 bits: the bound comes back bit for bit), the
per-layer state bounds of an approximate hit (up to `MAX_LAYERS`; a model with more linear layers
gets `state_bound_per_layer: None`, its `state_bound` is kept), and a CRC-32 of the rest (a torn or
misaligned copy is rejected). Fail closed: a row that is missing, not ours, another request's, or
damaged, or a label this version cannot encode (a key it does not know), gives the decode side
`exact: false, kv_exact: false, bound: None` of kind "transferred_unlabelled"
(`decode_side_label`).
"""

from __future__ import annotations

import struct
import zlib
from collections.abc import Sequence
from typing import Any

from sglang_ext.tail_replay.planner import UNDER_PRESSURE, HitKind
from sglang_ext.tail_replay.pressure import THRESHOLDS
from sglang_ext.tail_replay.request import KIND_ASSEMBLED, KIND_TRANSFERRED_UNLABELLED, KIND_UNTRACKED

#: int64 words per request (1 KiB; SGLang's metadata rows must be >= 64 bytes for RDMA)
ROW_WORDS = 128
#: "TRL_LABL": the first word of a row this extension wrote
MAGIC = 0x54524C5F4C41424C
#: the row's layout version (a decode server reads only the version it writes)
VERSION = 1
#: label kinds by code (append only: a code's meaning never changes within a version)
KINDS: tuple[str, ...] = ("exact_checkpoint", "exact_replay", "approximate", "approximate_checkpoint", "miss",
                          KIND_UNTRACKED, KIND_ASSEMBLED)
#: the live audit's reasons, by code - 1 (0: not audited)
AUDITS = ("forced", "sampled")
#: a pressed request's outcomes (`metrics.pressure_summary`), by code
OUTCOMES: tuple[str, ...] = (*UNDER_PRESSURE, "not_pressed")

# word positions
(_MAGIC, _VERSION, _ROOM, _KIND, _FLAGS, _BOUND, _MATCHED, _REUSED, _REPLAYED, _STATE_BOUND, _OUTCOME,
 _PRESSED_BY, _PLANNED_BOUND, _AUDIT, _LAYERS) = range(15)
_PER_LAYER = 15
_CRC = ROW_WORDS - 1
#: per-layer state bounds a row holds
MAX_LAYERS = _CRC - _PER_LAYER
# flag bits
_EXACT, _KV_EXACT, _HAS_BOUND, _HAS_PLAN, _HAS_STATE, _STATE_SET, _LAYERS_SET, _HAS_PRESSURE, _PLANNED_SET = (
    1 << i for i in range(9))
_ALL_FLAGS = (1 << 9) - 1
_PLAN_KEYS = ("matched_tokens", "reused_tokens", "replayed_tokens")
_KEYS = frozenset(("kind", "exact", "kv_exact", "bound", *_PLAN_KEYS, "audit", "pressure", "state_bound",
                   "state_bound_per_layer"))
_INT64 = struct.Struct("<q")
_FLOAT64 = struct.Struct("<d")

assert set(KINDS) >= {kind.value for kind in HitKind}, "every plan kind needs a code"


def fail_closed(kind: str) -> dict:
    """The label of an answer whose provenance is not known here (`metrics.answer_label`'s shape)."""
    return {"kind": kind, "exact": False, "kv_exact": False, "bound": None}


def _room_word(room: int | None) -> int:
    """SGLang's bootstrap room (uint64; None: 0) as a signed 64-bit word."""
    return ((int(room or 0) + 2**63) % 2**64) - 2**63


def _float_word(value: float) -> int:
    return int(_INT64.unpack(_FLOAT64.pack(float(value)))[0])


def _word_float(word: int) -> float:
    return float(_FLOAT64.unpack(_INT64.pack(word))[0])


def _crc(words: Sequence[int]) -> int:
    return zlib.crc32(struct.pack(f"<{_CRC}q", *words[:_CRC]))


def _is_bound(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and value >= 0   # NaN fails


def _is_count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value < 2**62


def encode_label(label: dict, room: int | None) -> list[int] | None:
    """The row carrying `label` (an `answer_label`) for the request of bootstrap room `room`, or
    None where this version cannot carry it exactly (an unknown key, kind or value): the caller
    then writes zeros and the decode side fails closed."""
    if not set(label) <= _KEYS or label.get("kind") not in KINDS:
        return None
    exact, kv_exact, bound = label.get("exact"), label.get("kv_exact"), label.get("bound")
    if not isinstance(exact, bool) or not isinstance(kv_exact, bool) or not (bound is None or _is_bound(bound)):
        return None
    words = [0] * ROW_WORDS
    words[_MAGIC], words[_VERSION], words[_ROOM] = MAGIC, VERSION, _room_word(room)
    words[_KIND] = KINDS.index(label["kind"])
    flags = (_EXACT if exact else 0) | (_KV_EXACT if kv_exact else 0)
    if bound is not None:
        flags |= _HAS_BOUND
        words[_BOUND] = _float_word(bound)
    present = [key in label for key in _PLAN_KEYS]
    if any(present):
        if not all(present) or not all(_is_count(label[key]) for key in _PLAN_KEYS):
            return None
        flags |= _HAS_PLAN
        words[_MATCHED], words[_REUSED], words[_REPLAYED] = (label[key] for key in _PLAN_KEYS)
    if "audit" in label:
        if label["audit"] not in AUDITS:
            return None
        words[_AUDIT] = AUDITS.index(label["audit"]) + 1
    if "pressure" in label:
        pressure = label["pressure"]
        if not isinstance(pressure, dict) or set(pressure) != {"pressed_by", "outcome", "planned_bound"}:
            return None
        pressed, outcome, planned = pressure["pressed_by"], pressure["outcome"], pressure["planned_bound"]
        if (not isinstance(pressed, list) or pressed != [name for name in THRESHOLDS if name in pressed]
                or outcome not in OUTCOMES or not (planned is None or _is_bound(planned))):
            return None
        flags |= _HAS_PRESSURE | (0 if planned is None else _PLANNED_SET)
        words[_OUTCOME] = OUTCOMES.index(outcome)
        words[_PRESSED_BY] = sum(1 << THRESHOLDS.index(name) for name in pressed)
        words[_PLANNED_BOUND] = 0 if planned is None else _float_word(planned)
    if ("state_bound" in label) != ("state_bound_per_layer" in label):
        return None
    if "state_bound" in label:
        state, per_layer = label["state_bound"], label["state_bound_per_layer"]
        if not (state is None or _is_bound(state)):
            return None
        flags |= _HAS_STATE | (0 if state is None else _STATE_SET)
        words[_STATE_BOUND] = 0 if state is None else _float_word(state)
        if per_layer is not None:
            if not isinstance(per_layer, list) or not all(_is_bound(value) for value in per_layer):
                return None
            if len(per_layer) <= MAX_LAYERS:   # more: the decode side gets None (its max is kept)
                flags |= _LAYERS_SET
                words[_LAYERS] = len(per_layer)
                words[_PER_LAYER:_PER_LAYER + len(per_layer)] = [_float_word(value) for value in per_layer]
    words[_FLAGS] = flags
    words[_CRC] = _crc(words)
    return words


def decode_label(words: Sequence[int] | None, room: int | None) -> dict | None:
    """The label a row carries for the request of bootstrap room `room`, or None: no row, a row
    this extension did not write (zeros, a stock prefill's), of another version, of another
    request, damaged (CRC), or inconsistent (e.g. `kv_exact` with a bound > 0)."""
    if words is None or len(words) != ROW_WORDS or not all(isinstance(word, int) for word in words):
        return None
    try:
        if words[_MAGIC] != MAGIC or words[_VERSION] != VERSION or words[_CRC] != _crc(words):
            return None
    except struct.error:   # a word outside int64
        return None
    flags = words[_FLAGS]
    if words[_ROOM] != _room_word(room) or flags & ~_ALL_FLAGS or not 0 <= words[_KIND] < len(KINDS):
        return None
    exact, kv_exact = bool(flags & _EXACT), bool(flags & _KV_EXACT)
    bound = _word_float(words[_BOUND]) if flags & _HAS_BOUND else None
    if bound is not None and not _is_bound(bound):
        return None
    if (exact and bound is None) or (kv_exact and bound != 0.0):
        return None
    label: dict = {"kind": KINDS[words[_KIND]]}
    if flags & _HAS_PLAN:
        counts = (words[_MATCHED], words[_REUSED], words[_REPLAYED])
        if not all(_is_count(count) for count in counts):
            return None
        label.update(zip(_PLAN_KEYS, counts))
    label.update(exact=exact, kv_exact=kv_exact, bound=bound)
    if words[_AUDIT]:
        if not 1 <= words[_AUDIT] <= len(AUDITS):
            return None
        label["audit"] = AUDITS[words[_AUDIT] - 1]
    if flags & _HAS_PRESSURE:
        planned = _word_float(words[_PLANNED_BOUND]) if flags & _PLANNED_SET else None
        if (not 0 <= words[_OUTCOME] < len(OUTCOMES) or not 0 <= words[_PRESSED_BY] < 1 << len(THRESHOLDS)
                or not (planned is None or _is_bound(planned))):
            return None
        label["pressure"] = {"pressed_by": [name for i, name in enumerate(THRESHOLDS) if words[_PRESSED_BY] >> i & 1],
                             "outcome": OUTCOMES[words[_OUTCOME]], "planned_bound": planned}
    if flags & _HAS_STATE:
        state = _word_float(words[_STATE_BOUND]) if flags & _STATE_SET else None
        per_layer = None
        if flags & _LAYERS_SET:
            if not 0 <= words[_LAYERS] <= MAX_LAYERS:
                return None
            per_layer = [_word_float(word) for word in words[_PER_LAYER:_PER_LAYER + words[_LAYERS]]]
        if not (state is None or _is_bound(state)) or not all(_is_bound(value) for value in per_layer or ()):
            return None
        label["state_bound"], label["state_bound_per_layer"] = state, per_layer
    return label


def decode_side_label(words: Sequence[int] | None, room: int | None, *, reads_own_tree: bool = False) -> dict:
    """The label of a decode-side answer: what the prefill side carried (`decode_label`); fail
    closed where it carried nothing readable ("transferred_unlabelled"), or where the decode side
    also reused its own tree's KV (`--disaggregation-decode-enable-radix-cache`: KV it inserted
    for transferred requests is UNTRACKED, so the answer read KV of unknown provenance:
    "untracked")."""
    if reads_own_tree:
        return fail_closed(KIND_UNTRACKED)
    label = decode_label(words, room)
    return label if label is not None else fail_closed(KIND_TRANSFERRED_UNLABELLED)


def merge_labels(earlier: dict | None, later: dict) -> dict:
    """The label of an answer whose request was transferred again (SGLang's PD rebootstrap after
    a retraction: the tokens it had generated stay in the answer): never better than the earlier
    one (a fail-closed label stays; bound the larger; exact, kv_exact only if both)."""
    if earlier is None:
        return later
    if earlier.get("bound") is None:
        return earlier
    if later.get("bound") is None:
        return later
    merged = dict(later)
    merged["bound"] = max(earlier["bound"], later["bound"])
    merged["exact"] = bool(earlier["exact"] and later["exact"])
    merged["kv_exact"] = bool(earlier["kv_exact"] and later["kv_exact"])
    return merged
