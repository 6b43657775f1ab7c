#!/usr/bin/env bash
# Tensor parallelism on two CUDA GPUs (never run: no machine with two GPUs was lent to this project).
# 1. the rank-agreement test over NCCL, each rank's gates on its own GPU (the suite runs it over gloo);
# 2. the demo (stock SGLang, then Tail-Replay: approximate replays whose bounds are gathered over the
#    attention-TP group in the gate hooks) on a tiny Qwen3-Next with --tp 2: both servers must answer
#    every turn (a rank that planned differently would hang or fail a shape check).
#   bash scripts/gpu_tp_checks.sh              # PYTHON=/path/to/python (default .venv/bin/python)
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
PY="${PYTHON:-.venv/bin/python}"
n=$("$PY" -c "import torch; print(torch.cuda.device_count())")
if [ "$n" -lt 2 ]; then echo "gpu_tp_checks: needs 2 CUDA GPUs, found $n" >&2; exit 1; fi
SGLANG_EXT_TP_CHECK_BACKEND=nccl "$PY" -m pytest -q -p no:cacheprovider tests/tail_replay/test_tp_agreement.py
"$PY" -m eval.demo --arch qwen3-next --workdir runs/gpu-tp2 --server-args "--tp 2"
