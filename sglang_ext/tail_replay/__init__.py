"""Tail-Replay: token-level prefix reuse for hybrid models without recurrent-state checkpoints.

`config` and `planner` are pure (no SGLang, no torch); `cache` adapts them to SGLang's
`UnifiedRadixCache` (registered as `--radix-cache-backend tail_replay`), and
`patches/tail_replay_batch.py` and `patches/tail_replay_attention.py` make the replayed tail read
the exact cached attention KV.
"""
