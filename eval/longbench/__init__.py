"""LongBench v1 / LongBench-E quality evaluation: official metrics, prompts and data loading.

Modules: `metrics` (the official per-answer metrics), `scoring` (the official eval.py's rules:
which metric per dataset, sample and dataset scores, LongBench-E buckets), `config` (official
prompts, generation lengths, dataset lists, `build_prompt`), `data` (local JSONL and Hugging
Face Hub loading).
"""
