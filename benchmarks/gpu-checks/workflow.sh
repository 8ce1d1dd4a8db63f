#!/usr/bin/env bash
# Issue 41, second device call: config/examples/smollm2-it-cs.yaml end to end on the GPU (bf16, the local
# profile, one GPU per train job) and its LoRA twin side by side, through benchmarks/smollm2.py; then the evaluation
# speed comparison on the converted SmolLM2-135M. The GGUF file (98 MB) is over one call's 64 MiB, so it
# travels in two halves: .gpuA/part with the first call (speed.sh, which copies it to /tmp), .gpuB/part
# with this one, on the same warm machine. At most 8 files come back under $OUT.
#
#     OUT=$OUT benchmarks/gpu-checks/workflow.sh     # device call: carry [".gpuwhl2", ".gpuB"]
set -u
: "${OUT:?set OUT to the folder that comes back}"
mkdir -p "$OUT"
site=/tmp/fedtune-site
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$site" .gpuwhl2/*.whl || exit 1
export PYTHONPATH="$site:$PWD" PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 PATH="$site/bin:$PATH"
gguf=/tmp/SmolLM2-135M-Instruct.Q4_1.gguf
want=b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53
cat /tmp/gguf-partA .gpuB/part > "$gguf" 2>/dev/null
if [ "$(sha256sum < "$gguf" | cut -c1-64)" != "$want" ]; then
    echo "the GGUF's halves did not meet (a fresh machine has no /tmp/gguf-partA): no workflow run" | tee "$OUT/workflow.txt"
    exit 3
fi
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/workflow.txt"
python3 -c "import torch, transformers, snakemake; print('torch', torch.__version__, 'transformers', transformers.__version__, 'snakemake', snakemake.__version__)" | tee -a "$OUT/workflow.txt"
run() {  # name, seconds, extra arguments
    local name=$1 limit=$2; shift 2
    timeout "$limit" python3 benchmarks/smollm2.py --workdir "/tmp/$name" --gpu --gguf "$gguf" \
        --snakemake-args="--scheduler greedy" "$@" > "$OUT/$name.json" 2> "$OUT/$name.log"
    echo "$name exit $? after $SECONDS s"
    grep -A3 '"gap_to_pooled"' "$OUT/$name.json"
}
SECONDS=0
# Side by side: a 135M model leaves the GPU and 16 cores mostly idle, and the call is short.
run workflow-full "${RUN_S:-240}" &
run workflow-lora "${RUN_S:-240}" --lora &
wait
texts="data/real/libreoffice-help-it/test.jsonl data/real/libreoffice-help-cs/test.jsonl"
# shellcheck disable=SC2086
timeout 45 python3 benchmarks/evaluation.py --device cuda --dtype bfloat16 --texts $texts --documents 400 \
    --model /tmp/workflow-full/results/smollm2-it-cs/model/base --max-length 2048 --stride 1024 --batch-size 16 \
    --out "$OUT/gpu-evaluation-smollm2.json" > /dev/null 2>> "$OUT/workflow.txt"
echo "evaluation.py exit $?"; grep -E '"tokens_per_s"|"speedup"' "$OUT/gpu-evaluation-smollm2.json"
