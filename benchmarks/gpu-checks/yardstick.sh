#!/usr/bin/env bash
# Issue 39 on one GPU (2026-11-28): the federation yardstick's cells that two CPU cores could not run,
# on the product's code (benchmarks/federation_yardstick.py, training and scoring on CUDA):
#   - the fine-tuning regime at 4 times its steps (4 rounds x 12 steps) on both confirmation sets
#     (it-cs, ref-fr+code), seeds 0-2: plain FedAvg at lr 1/2/4x (4x: its tuning-half best at 3 steps),
#     the pooled model at 0.5/1/2/4x;
#   - the LoRA regime's confirmation (it-cs, seeds 0-2), each model at its tuning-half point.
# Each (set, seed) is a process of its own beside the others (one H200, 16 cores). The second of two
# calls: the first leaves the GGUF's first half in /tmp/gguf-partA (one call carries 64 MiB at most).
#
#     OUT=$OUT benchmarks/gpu-checks/yardstick.sh     # carry [".gpuB", ".gpuC"]: gpu-checks/README.md
# EXTRA (appended to every command) cuts the cells for a trial run on a CPU: EXTRA="--rounds 1 --steps 1".
set -u
: "${OUT:?set OUT to the folder that comes back}"
mkdir -p "$OUT"
if [ -d .gpuC/whl ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/fedtune-site .gpuC/whl/*.whl || exit 1
    export PYTHONPATH="/tmp/fedtune-site:$PWD"
fi
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
gguf=.cache/models/smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
if [ ! -f "$gguf" ]; then
    mkdir -p "$(dirname "$gguf")"
    cat /tmp/gguf-partA .gpuB/part > "$gguf" || exit 1
fi
echo "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53  $gguf" | sha256sum -c - || exit 1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader > "$OUT/gpu.txt" 2>&1
python3 -c "import torch, transformers, peft; print('torch', torch.__version__, 'transformers', transformers.__version__, 'peft', peft.__version__)" >> "$OUT/gpu.txt" 2>&1
cat "$OUT/gpu.txt"
results=/tmp/yardstick-results
rm -rf "$results"
mkdir -p "$results"
federations=benchmarks/results/federation
job() {  # name, then the benchmark's arguments
    local name=$1
    shift
    # shellcheck disable=SC2086
    timeout "${LIMIT_S:-500}" python3 benchmarks/federation_yardstick.py --text .gpuC/text \
        --work "/tmp/yardstick-$name" --out-csv "$results/$name.csv" "$@" ${EXTRA:-} > "$results/$name.log" 2>&1
    echo "$name exit $?" >> "$results/exits.txt"
}
for seed in 0 1 2; do
    for set in it-cs ref-fr+code; do
        job "length-$set-$seed" --regime finetune --half confirmation --sets "$set" --steps 12 --seeds "$seed" \
            --strategies fedavg --lr-factors 1 2 4 --pooled-lr-factors 0.5 1 2 4 &
    done
    job "lora-$seed" --regime lora --half confirmation --sets it-cs --seeds "$seed" \
        --strategies fedavg fedavgm-vocab --chosen "$federations/yardstick-tuning-v4-lora.csv" &
done
wait
cat "$results/exits.txt"
# At most 8 files come back: one CSV per kind, the exits and every log in one file.
for kind in length lora; do
    python3 - "$results" "$kind" "$OUT/yardstick-gpu-$kind.csv" <<'PY'
import sys
from pathlib import Path

import pandas as pd

paths = sorted(Path(sys.argv[1]).glob(f"{sys.argv[2]}-*.csv"))
if paths:
    pd.concat([pd.read_csv(p) for p in paths]).to_csv(sys.argv[3], index=False)
PY
done
cp "$results/exits.txt" "$OUT/"
for log in "$results"/*.log; do
    echo "=== $(basename "$log")"
    grep -v "it/s\]$\|s/it\]$" "$log" | tail -n 60
done > "$OUT/logs.txt"
