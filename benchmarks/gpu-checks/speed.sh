#!/usr/bin/env bash
# Issue 41, first device call: evaluation speed (fedtune's scoring against the Hugging Face perplexity
# guide's loop, SmolLM2-1.7B's shape, real text), then the MFU levers on the 2.7B Llama of
# gpu_training.py beside the HF Trainer. Installs the wheels into /tmp/fedtune-site, where the second call
# (workflow.sh) finds them on a warm machine. At most 8 files come back under $OUT.
#
#     OUT=$OUT benchmarks/gpu-checks/speed.sh        # device call: carry [".gpuwhl1", ".gpuA"]
set -u
: "${OUT:?set OUT to the folder that comes back}"
mkdir -p "$OUT"
site=/tmp/fedtune-site
# A carried folder does not stay for the next call: the GGUF's first half waits outside the tree.
[ -f .gpuA/part ] && cp .gpuA/part /tmp/gguf-partA
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$site" .gpuwhl1/*.whl || exit 1
export PYTHONPATH="$site:$PWD" PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
texts="data/real/libreoffice-help-it/test.jsonl data/real/libreoffice-help-cs/test.jsonl"
# shellcheck disable=SC2086
timeout 90 python3 benchmarks/evaluation.py --device cuda --dtype bfloat16 --arch smollm2-1.7b --texts $texts \
    --documents 400 --vocab-size 8192 --max-length 2048 --stride 1024 --batch-size 16 \
    --out "$OUT/gpu-evaluation.json" > "$OUT/gpu-evaluation.log" 2>&1
echo "evaluation.py exit $?"; grep -E '"tokens_per_s"|"speedup"|relative' "$OUT/gpu-evaluation.json"
BUDGET_S=${BUDGET_S:-260} benchmarks/gpu-checks/training.sh \
    --runs fsdp_fast_mb4,hf_trainer_mb4,fsdp_fast_mb4_noreshard,fsdp_compile_model_mb4,fsdp_fast_mb4_ac,fsdp_fast_mb2,hf_trainer_mb2 \
    --steps 14 --measure-after 4 "$@"
