"""Live-server trace replay: real traces through patched SGLang servers, side by side
(`python -m eval.replay --help`; docs/trace_replay.md)."""
