#!/usr/bin/env bash
# Every GPU check of issue 27 in one device call (about 8 minutes on an H100): the suite's CUDA-only tests
# (pytest -m gpu), then training.sh (fedtune against the HF Trainer on the largest Llama that fits,
# QLoRA, peak memory against docs/scaling.md's formula). At most 8 files come back under $OUT:
# gpu.txt, pytest-gpu.log, gpu-training.{json,md,log} and run-logs.txt.
#
#     WHEELS=.gpuwhl OUT=$OUT benchmarks/gpu-checks/all.sh     # .gpuwhl: gpu-checks/README.md
set -u
: "${OUT:?set OUT to the folder that comes back}"
mkdir -p "$OUT"
site=$(mktemp -d)
if [ -n "${WHEELS:-}" ]; then
    # The machine has no network: jsonschema (and its parts), datasets, peft, bitsandbytes as wheels.
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$site" "$WHEELS"/*.whl || exit 1
    export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}"
fi
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
python3 -c "import bitsandbytes, peft; print('bitsandbytes', bitsandbytes.__version__, 'peft', peft.__version__)" 2>&1 | tail -1 | tee "$OUT/versions.txt"
timeout 120 python3 -m pytest -m gpu -ra -q -p no:cacheprovider --continue-on-collection-errors tests > "$OUT/pytest-gpu.log" 2>&1
echo "pytest -m gpu exit $? ($(tail -1 "$OUT/pytest-gpu.log"))"
unset WHEELS  # installed above, for both steps
benchmarks/gpu-checks/training.sh "$@"
