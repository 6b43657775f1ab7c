"""The LRU expert and its judge.

LRU proposes its own victim next to the model's. Every disagreement that is acted upon
becomes a *duel*, judged afterwards by Belady's rule on the pair: whichever of the two
candidates is referenced first should have been kept, weighted by what was at stake
(its blocks times its recompute cost per block ** power). SAE follows the model only
while it wins at least half of the recent weighted duels (``SAEState.model_win_rate``).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Mapping
from typing import NamedTuple

from ..base import Key, LazyMinHeap
from .config import SAEAblation, SAEConfig
from .learning import SAEState
from .owners import Entry


class Proposals(NamedTuple):
    """The victims the model and LRU proposed at the last ``victim()`` call."""

    model: Key | None
    lru: Key | None


NO_PROPOSALS = Proposals(None, None)


class Stake(NamedTuple):
    """What a duel candidate is worth if it should have stayed."""

    cost_bucket: int  # log2 recompute cost per block
    blocks: int  # 1 when ``duel_stake_blocks`` is off


class Duel(NamedTuple):
    """A disagreement acted upon: ``evicted`` went, ``kept`` stayed."""

    evicted: Key
    kept: Key
    model_evicted: bool  # True: the model's choice was executed
    evicted_stake: Stake
    kept_stake: Stake
    t: float  # eviction time


class LRUExpert:
    """The evictable entries by last access, and the pending duels."""

    def __init__(self, config: SAEConfig, ablation: SAEAblation, state: SAEState) -> None:
        self.config, self.ablation, self.state = config, ablation, state
        self.lru = LazyMinHeap()  # all evictable entries by last access
        self.proposals = NO_PROPOSALS
        self._duels: OrderedDict[int, Duel] = OrderedDict()
        self._duels_of: dict[Key, list[int]] = {}
        self._duel_ids = 0

    def choose(self, model: Key) -> Key | None:
        """The victim to execute given the model's: the model's while it wins at least
        half of the weighted duels (or LRU agrees), else LRU's. Mutates: ``proposals``."""
        lru = self.lru.peek()
        self.proposals = Proposals(model, lru)  # judged later if the two experts disagree
        if lru == model or self.state.model_win_rate >= 0.5:
            return model
        return lru

    def note_duel(self, key: Key, entries: Mapping[Key, Entry], now: float) -> None:
        """Called before ``key`` is trimmed: if the model and LRU disagreed, remember the
        pair; whichever is referenced first should have stayed. Mutates: ``proposals`` (reset), duels."""
        model, lru = self.proposals
        self.proposals = NO_PROPOSALS
        if lru is None or model is None or lru == model or key not in (lru, model):
            return
        other = model if key == lru else lru
        self._duel_ids += 1
        ek, eo = entries[key], entries[other]
        if self.ablation.duel_stake_blocks:
            stakes = Stake(ek.cost_bucket, ek.n_blocks), Stake(eo.cost_bucket, eo.n_blocks)
        else:
            stakes = Stake(ek.cost_bucket, 1), Stake(eo.cost_bucket, 1)
        self._duels[self._duel_ids] = Duel(key, other, key == model, *stakes, now)
        for k in (key, other):
            self._duels_of.setdefault(k, []).append(self._duel_ids)

    def referenced(self, key: Key) -> None:
        """``key`` is referenced (cached again or hit): it decides every pending duel it is
        in. Mutates: duels, the win rate in the state."""
        ids = self._duels_of.pop(key, None)
        if not ids:
            return
        for duel_id in ids:
            duel = self._duels.pop(duel_id, None)
            if duel is None:
                continue
            other = duel.kept if key == duel.evicted else duel.evicted
            self._unlink(duel_id, other, other)
            # the one referenced first should have been kept; what was at stake is its
            # recompute cost (the model's own objective: cost per block ** cost_power)
            kept_first = key == duel.kept
            model_right = kept_first == duel.model_evicted
            power = self.ablation.duel_cost_power
            power = self.config.cost_power if power is None else power
            first = duel.kept_stake if kept_first else duel.evicted_stake
            stake = first.blocks * 2.0 ** (first.cost_bucket * power)
            self.score(model_right, stake)

    def expire(self, limit: int, now: float | None) -> None:
        """Unresolved duels (neither candidate back) are dropped as ties once older than
        ``duel_window`` residence times H or beyond ``limit * duel_cap_factor`` (FIFO); a
        short window would only resolve the duels won by whichever candidate returns
        quickly and bias the judge towards LRU. Mutates: duels."""
        if not self._duels:
            return
        assert now is not None, "duels exist only after an eviction, which sets the time"
        window = self.ablation.duel_window * self.state.horizon_s
        cap = limit * self.ablation.duel_cap_factor
        while self._duels:
            duel_id, duel = next(iter(self._duels.items()))
            if len(self._duels) <= cap and now - duel.t <= window:
                break
            self._duels.popitem(last=False)
            self._unlink(duel_id, duel.evicted, duel.kept)

    def _unlink(self, duel_id: int, a: Key, b: Key) -> None:
        for k in {a, b}:
            ids = self._duels_of.get(k)
            if ids and duel_id in ids:
                ids.remove(duel_id)
                if not ids:
                    del self._duels_of[k]

    def score(self, right: bool, stake: float = 1.0) -> None:
        """One judged duel: the model was ``right`` or not, ``stake`` at stake. Mutates
        (when learning): the state's duel sums and ``model_win_rate``."""
        if not self.config.learning:
            return
        state = self.state
        state.duels += 1
        keep = 1.0 - max(1.0 / state.duels, self.config.expert_rate)
        state.duel_win_ew = keep * state.duel_win_ew + stake * float(right)
        state.duel_weight_ew = keep * state.duel_weight_ew + stake
        state.model_win_rate = state.duel_win_ew / state.duel_weight_ew
