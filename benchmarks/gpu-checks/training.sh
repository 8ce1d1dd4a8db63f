#!/usr/bin/env bash
# GPU check of the speed goals in one call: benchmarks/gpu_training.py's runs (fedtune FSDP2 bf16 with
# the speed options, the HF Trainer, QLoRA, plain FSDP2, DeepSpeed ZeRO-2 and ZeRO-3 where deepspeed is
# there) on one H100/H200, within BUDGET_S seconds (default 400: a 10-minute device call less its start
# and the pytest check of all.sh). Writes only under $OUT: gpu.txt, gpu-training.json, gpu-training.md
# (the table for a result file in benchmarks/results/gpu), gpu-training.log and run-logs.txt (the end of each run's log);
# the starting weights and every cache live in a temporary folder that is removed at the end.
#
#     OUT=/tmp/out benchmarks/gpu-checks/training.sh                      # wheels already installed
#     WHEELS=build/wheels OUT=$OUT benchmarks/gpu-checks/training.sh      # carry jsonschema, deepspeed
set -u
: "${OUT:?set OUT to the folder that comes back}"
mkdir -p "$OUT"
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
if [ -n "${WHEELS:-}" ]; then
    # The machine has no network: the wheels the CPU side downloaded (gpu-checks/README.md).
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$work/site" "$WHEELS"/*.whl || exit 1
    export PYTHONPATH="$work/site${PYTHONPATH:+:$PYTHONPATH}"
fi
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TMPDIR="$work"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/gpu.txt"
python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)" | tee -a "$OUT/gpu.txt"
runs=all
if ! python3 -c "import deepspeed" 2>/dev/null; then
    # The goal's pair does not need DeepSpeed; say what was left out rather than fail every run.
    echo "deepspeed missing: the ZeRO runs are left out" | tee -a "$OUT/gpu.txt"
    runs=fsdp_fast,hf_trainer,qlora,fsdp_fast_mb2,fsdp
fi
python3 benchmarks/gpu_training.py --runs "$runs" --budget-s "${BUDGET_S:-400}" --workdir "$work" \
    --logs "$work/logs" --out "$OUT/gpu-training.json" "$@" > /dev/null 2> "$OUT/gpu-training.log"
rc=$?
# One file for every run's log: the device call returns at most 8 files.
for log in "$work"/logs/*.log; do
    echo "=== $(basename "$log")"
    tail -n 80 "$log"
done > "$OUT/run-logs.txt" 2>/dev/null
# The Markdown table is the end of stderr, from its title line on; the JSON is in gpu-training.json.
sed -n '/parameters, seq/,$p' "$OUT/gpu-training.log" > "$OUT/gpu-training.md"
grep '^\[gpu benchmark\]' "$OUT/gpu-training.log" | cut -c1-400
cat "$OUT/gpu-training.md"
echo "gpu_training.py exit $rc; $OUT/gpu-training.json"
exit $rc
