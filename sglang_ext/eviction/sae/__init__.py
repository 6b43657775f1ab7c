"""SAECache: semantic-adaptive eviction (design and math: docs/saecache.md).

Cached entries belong to *owners*: the session whose private context they are
(``session`` queue), the single request of unknown session that brought them
(``single``), or, once a second session / request reads them, the entry itself
(``shared``). An owner is in a *state*: the token type its last request ended with
(split by the size of the cached output), e.g. a tool call -> the next request is
seconds away, a response -> a user has to answer. Per reuse class (queue, state) SAE
fits online a log-normal model of the time T to the owner's next reference (for
sessions: the gap between requests, observed exactly) and the chance rho that there is
one at all.

To free space SAE evicts the evictable entry with the smallest hit density

    v = H * g_c(a) / E[time held] * cost_per_block ** p,
    g_c(a) = P(next reference within H | none for age a) = rho (S(a) - S(a + H)) / (rho S(a) + 1 - rho)

with ``S`` the log-normal survival, ``a`` the entry's age, ``H`` the cache's mean
block residence time (Little's law: cached blocks / eviction rate) and ``E[time held]``
the expected time until the reference or for H, whichever comes first: references per
block-second of cache, as in LHD (Beckmann et al., NSDI'18). Overdue owners (S(a) small)
and owners whose next request is far away go first; owners about to return are kept
whole.

A second expert, LRU, proposes its own victim. Every disagreement is judged afterwards
by Belady's rule on the pair (whichever of the two candidates is referenced first
should have been kept, weighted by its recompute cost) and SAE follows the model only
while it wins at least half of the recent weighted disagreements. Deterministic: no
randomness, insertion-ordered containers, heaps with sequence-number tie-breaks.

Modules:

* ``config``: ``SAEConfig`` (user settings) and ``SAEAblation`` (design switches);
* ``keys``: ``ReuseClass`` (queue, state), the class a fit is learned for, and
  ``RankClass`` (reuse class, cost bucket, pace), the queue an owner is ranked in;
* ``reuse_model``: the log-normal fit, rho, g(a) and the hit density (pure math);
* ``learning``: ``SAEState`` (everything learned) and the ``Learner`` (fits, H, ghosts);
* ``owners``: entries, owners, the rank-class heaps, the session clock;
* ``expert``: the LRU expert and the duel judge;
* ``policy``: ``SAEPolicy``, composing them.

Ablation policies (e.g. ``sae-model``, the model without the LRU expert) are not
products; they live with the simulator (``eval/trace_sim/ablations.py``).
"""

from __future__ import annotations

from .config import SAEAblation, SAEConfig, SAEConfigError
from .keys import OutputState, RankClass, ReuseClass
from .learning import SAEState
from .policy import SAEPolicy
from .reuse_model import ClassStats, ReuseTimeModel, hit_density, soon

__all__ = ["ClassStats", "OutputState", "RankClass", "ReuseClass", "ReuseTimeModel",
           "SAEAblation", "SAEConfig", "SAEConfigError", "SAEPolicy", "SAEState",
           "hit_density", "soon"]
