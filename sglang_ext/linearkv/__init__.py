"""LinearKV: position-independent chunk caching for hybrid models (attention + GDN / Mamba-2).

Pure core (no SGLang import): `store` (chunk cache keyed by content and model), `initializers`
(seeds for the linear layers' recomputed spans), `selectors` (which tokens to recompute), `ops`
(state composition, key re-rotation; backed by `hybrid_kernels`). `reference` runs the method over
transformers models (registration, assembly, greedy decode) as the ground truth the SGLang adapter
must reproduce.
"""

from sglang_ext.linearkv.initializers import STATE_RULES, get_state_rule
from sglang_ext.linearkv.selectors import SELECTOR_KINDS, Selector, parse_selector
from sglang_ext.linearkv.store import ChunkEntry, ChunkReferenceError, ChunkStore, LinearLayerState, chunk_id

__all__ = ["STATE_RULES", "get_state_rule", "SELECTOR_KINDS", "Selector", "parse_selector", "ChunkEntry",
           "ChunkReferenceError", "ChunkStore", "LinearLayerState", "chunk_id"]
