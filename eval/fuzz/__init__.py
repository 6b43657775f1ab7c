"""Differential exactness fuzzer: seeded hostile-but-valid workloads against live
Tail-Replay and LinearKV servers, every answer labelled exact compared with a server without cache.

- `workload`: the seeded generator (pure);
- `client`: sends a workload to a server, one observation per request;
- `oracles`: exactness against the server without cache, tenant isolation by cached tokens, SGLang's
  strict idle pool check / tree sanity check and tracebacks in the log, 5xx answers;
- `reference`: the server without cache's answers and its run-to-run noise (the tolerance);
- `shrink`: a violation's minimal sequential reproduction;
- `configs`: the server configurations; `runner`: seeds against one running server.

The suite runs a small seed set (`tests/e2e/test_exactness_fuzz.py`); the long run is
`python -m benchmarks.exactness_fuzz` (report in `docs/results/exactness-fuzz/`).
"""
