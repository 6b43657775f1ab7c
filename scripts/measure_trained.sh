#!/usr/bin/env bash
# Measure one trained model folder end to end (CPU, patched SGLang servers):
#   1. RULER-style accuracy at 1K-8K through the server (full prefill) -> ruler_scores.json
#   2. learned decay / half-lives per linear layer and head             -> decay.json
#   3. model card + loss plot                                           -> README.md, loss_curve.png
#   4. quality retained under Tail-Replay (RULER, 4K / 8K, every configuration) and the LongBench
#      path on a locally built LongBench-format set                    -> docs/results/<name>/
# Usage: bash scripts/measure_trained.sh trained_models/gdn-ruler
#   env: SAMPLES (per RULER cell), Q_SAMPLES, Q_TASKS, Q_LENGTHS, Q_CONFIGS, LB_CONFIGS (quality runs),
#        STEPS (which of 1-4)
set -euo pipefail
MODEL=${1:?model folder}
NAME=$(basename "$MODEL")
SAMPLES=${SAMPLES:-5}
Q_SAMPLES=${Q_SAMPLES:-4}
Q_TASKS=${Q_TASKS:-niah_single_2,niah_multikey_1}
Q_LENGTHS=${Q_LENGTHS:-4096,8192}
# every default configuration, plus tr-0 (no replay: the linear layers start from a zero state,
# the negative control) and tr-0.5 (below the defaults)
Q_CONFIGS=${Q_CONFIGS:-full,stock,tr-0,tr-0.5,tr-2.5,tr-5,tr-10,tr-20,tr-2.5-recompute,tr-5-recompute,tr-10-recompute,tr-20-recompute}
LB_CONFIGS=${LB_CONFIGS:-full,stock,tr-0,tr-2.5,tr-5,tr-10,tr-20,tr-50,tr-5-recompute,tr-10-recompute}
STEPS=${STEPS:-1234}
PY=${PY:-.venv/bin/python}
OUT=runs/quality-$NAME
RESULTS=docs/results/$NAME

step() { [[ $STEPS == *$1* ]]; }
step 1 && $PY -m eval.training.evaluate --model "$MODEL" --samples "$SAMPLES"
step 2 && $PY -m eval.training.decay --model "$MODEL" --samples 8
step 3 && $PY -m eval.training.card --model "$MODEL"
step 4 || exit 0
$PY -m eval.quality run --benchmark ruler --model "$MODEL" --tasks "$Q_TASKS" \
    --lengths "$Q_LENGTHS" --configs "$Q_CONFIGS" --samples "$Q_SAMPLES" --out "$OUT/ruler"
$PY -m eval.quality make-longbench --out "$OUT/longbench-data" --words 1500 --samples "$Q_SAMPLES"
$PY -m eval.quality run --benchmark longbench --model "$MODEL" --datasets hotpotqa,multifieldqa_en \
    --source "$OUT/longbench-data" --configs "$LB_CONFIGS" \
    --samples "$Q_SAMPLES" --out "$OUT/longbench"
mkdir -p "$RESULTS"
for b in ruler longbench; do
  cp "$OUT/$b/summary.md" "$RESULTS/$b-summary.md"
  cp "$OUT/$b/summary.json" "$RESULTS/$b-summary.json"
  cp "$OUT/$b/retention.png" "$RESULTS/$b-retention.png"
done
