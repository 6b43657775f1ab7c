"""Tiny random-weight fixture checkpoints (and their tokenizer) for tests and demos."""
