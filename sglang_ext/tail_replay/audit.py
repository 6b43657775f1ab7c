"""Live quality audit: how far an approximate answer's next-token distribution is from an exact one.

Off by default. A server with `audit_rate` > 0 audits that share of its approximate answers (those
whose provenance is not exact: `exact` false in meta_info), and a request with `audit: true` is
audited whatever it was. An audit compares the served request's next-token distribution at its
first output (the model's raw logits at the last prompt position, before any sampling parameter)
with a reference: the same prompt re-run with `exactness: "exact"` (only strictly exact KV and
states reused, so the same distribution as a full prefill), one greedy token, sent by the
tokenizer process through SGLang's own request path at the least-favoured priority
(`patches/tail_replay/audit.py`), marked as the server's own run out of band (`audit_of` is no
request field: `config.BACKGROUND_PARAM_KEY`). Recorded per audit: KL(reference || served) over the whole
vocabulary, the total variation distance, and whether both put the same token first.

Pure: no SGLang import; torch is imported where a tensor is handled. This module holds the
sampling decision, the divergence, the scheduler's bounded store of served distributions waiting
for their reference, and the log line.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

#: why a request is audited (the `trigger` label of the audit metrics, and meta_info's `audit`)
FORCED, SAMPLED = "forced", "sampled"
TRIGGERS = (FORCED, SAMPLED)
#: served distributions kept waiting for their reference (oldest dropped first); one vocabulary row
#: of float32 each (a 152K vocabulary: 0.6 MB)
MAX_PENDING = 32


def sampled(rid: str, rate: float) -> bool:
    """Whether the request `rid` falls in the audited share `rate` of approximate answers: a
    uniform draw in [0, 1) from a hash of the rid, so every rank of a replica, and every rerun of
    the same request id, decides the same."""
    if rate <= 0.0:
        return False
    if rate >= 1.0:
        return True
    draw = int.from_bytes(hashlib.sha256(rid.encode()).digest()[:8], "big") / 2.0 ** 64
    return draw < rate


def audit_trigger(*, forced: bool, reference: bool, exact: bool, rid: str, rate: float) -> str | None:
    """Why a request is audited (FORCED or SAMPLED), or None: a reference run is never audited; a
    forced one always; otherwise an answer that is not exact, with probability `rate`."""
    if reference:
        return None
    if forced:
        return FORCED
    if not exact and sampled(rid, rate):
        return SAMPLED
    return None


def prompt_key(ids: Sequence[int]) -> str:
    """A digest of the prompt's token ids: a reference must have run the served request's prompt."""
    return hashlib.sha256(array("q", ids).tobytes()).hexdigest()


@dataclass(frozen=True)
class Divergence:
    """How far the served next-token distribution is from the reference's."""

    #: KL(reference || served) in nats, over the whole vocabulary (0 when they are equal)
    kl: float
    #: total variation distance, 0.5 * sum |p_ref - p_served|, in [0, 1]
    tv: float
    #: whether both distributions put the same token first
    top1_agree: bool
    #: the tokens they put first
    reference_top1: int
    served_top1: int


def log_probs(logits: torch.Tensor) -> torch.Tensor:
    """One row of logits -> float32 log-probabilities on the CPU (what the store keeps)."""
    import torch

    return torch.log_softmax(logits.detach().float(), dim=-1).cpu()


def divergence(reference: torch.Tensor, served: torch.Tensor) -> Divergence:
    """Divergence of two next-token distributions given as log-probabilities (1-D, same vocabulary).

    KL sums p_ref * (log p_ref - log p_served) where p_ref > 0 (a token the reference never emits
    contributes nothing; one the served side rules out and the reference does not makes KL
    infinite). Computed in float64; a KL below 0 from rounding is reported as 0."""
    import torch

    if reference.shape != served.shape or reference.dim() != 1:
        raise ValueError(f"next-token distributions of different shapes: {tuple(reference.shape)} "
                         f"vs {tuple(served.shape)}")
    ref, srv = reference.double(), served.double()
    p_ref = ref.exp()
    support = p_ref > 0
    kl = float(torch.where(support, p_ref * (ref - srv), torch.zeros_like(ref)).sum())
    tv = 0.5 * float((p_ref - srv.exp()).abs().sum())
    ref_top, srv_top = int(ref.argmax()), int(srv.argmax())
    return Divergence(kl=max(kl, 0.0), tv=min(max(tv, 0.0), 1.0), top1_agree=ref_top == srv_top,
                      reference_top1=ref_top, served_top1=srv_top)


@dataclass(frozen=True)
class ServedAnswer:
    """An audited request's next-token distribution, waiting for its reference."""

    rid: str
    trigger: str
    #: the plan's hit kind and the provenance bound of the state the answer started from
    kind: str
    bound: float
    exact: bool
    #: `prompt_key` of its prompt
    prompt: str
    #: log-probabilities (float32, CPU)
    log_probs: torch.Tensor


class PendingAudits:
    """Served distributions by rid, waiting for their reference: at most `capacity`, the oldest
    dropped first (a reference that never ran, or ran on another replica, leaves nothing behind)."""

    def __init__(self, capacity: int = MAX_PENDING) -> None:
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1, got {capacity}")
        self.capacity = capacity
        self._served: OrderedDict[str, ServedAnswer] = OrderedDict()
        #: rids dropped for room, for the log line of a reference that comes too late
        self.dropped = 0

    def __len__(self) -> int:
        return len(self._served)

    def __contains__(self, rid: object) -> bool:
        return rid in self._served

    def add(self, answer: ServedAnswer) -> None:
        self._served.pop(answer.rid, None)
        self._served[answer.rid] = answer
        while len(self._served) > self.capacity:
            self._served.popitem(last=False)
            self.dropped += 1

    def take(self, rid: str) -> ServedAnswer | None:
        return self._served.pop(rid, None)


@dataclass(frozen=True)
class AuditResult:
    served: ServedAnswer
    reference_rid: str
    divergence: Divergence

    def log_line(self) -> str:
        s, d = self.served, self.divergence
        return (f"Tail-Replay audit: rid={s.rid} trigger={s.trigger} kind={s.kind} bound={s.bound:.3e} "
                f"exact={str(s.exact).lower()} kl={d.kl:.3e} tv={d.tv:.3e} "
                f"top1_agree={str(d.top1_agree).lower()} (served top-1 {d.served_top1}, reference "
                f"{d.reference_top1}; reference rid={self.reference_rid})")


def reference_overrides(rid: str) -> dict:
    """The config values of the reference run for the audited request `rid` (the server's mark on
    it, `request_fields.background_mark`, set out of band: no client can send them): exact reuse only, and
    no state stored (an audit takes no checkpoint slot from the traffic)."""
    return {"exactness": "exact", "keep_checkpoints": False, "audit_of": rid}
