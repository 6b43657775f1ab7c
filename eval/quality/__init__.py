"""Quality retained under cache reuse: LongBench and RULER against a live SGLang server.

    python -m eval.quality run --benchmark ruler --model trained_models/gdn-ruler \
        --tasks niah_single_2,vt --lengths 4096,8192 --samples 5 --out runs/quality-gdn
    python -m eval.quality report --out runs/quality-gdn
    python -m eval.quality retention --perplexity runs/ppl-gdn --ruler runs/quality-gdn   # fixed vs auto budgets

Every sample runs under every configuration (`configs.CONFIGS`): full prefill without reuse,
stock SGLang cache, Tail-Replay at several budgets with exact or recomputed KV (also the
decay-certified `tr-auto-<tolerance>[-p<N>]`, by name). Reuse happens
as in serving: the shared document is sent first with another question (warming the cache),
then the real request; `meta_info` must show the hit (`runner.HitCheck`).

Modules: configs (the configurations), samples (the common sample type), ruler / longbench
(sample sources and scorers), servers (clients; launching patched servers), runner (the loop,
resumable JSONL), report (table and plot), perplexity (continuation perplexity), retention
(fixed vs decay-certified table), cli.
"""
