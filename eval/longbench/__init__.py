"""LongBench v1 / LongBench-E quality evaluation: official metrics, prompts and data loading.

Modules: `metrics` (official scoring), `config` (official prompts, generation lengths, dataset
lists, `build_prompt`), `data` (local JSONL and Hugging Face Hub loading).
"""
