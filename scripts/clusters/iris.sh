# Iris (ULHPC). Sourced by `scripts/launch --cluster iris` in every training task.
# Each setting keeps a value already exported (e.g. in ~/.bashrc or before running Snakemake).

# Modules to load, space separated; empty with a venv or container that brings its own CUDA/NCCL
# (the PyTorch wheels do). Example: export FEDTUNE_MODULES="lang/Python system/CUDA"
if [[ -n ${FEDTUNE_MODULES:-} ]] && type module >/dev/null 2>&1; then module load $FEDTUNE_MODULES; fi

# V100 GPUs have no bf16. The trainer refuses precision bf16 when FEDTUNE_NO_BF16=1 (use fp16, which
# trains with loss scaling, or fp32) instead of failing or silently emulating it.
export FEDTUNE_NO_BF16=1

export FEDTUNE_SCRATCH=${FEDTUNE_SCRATCH:-${SCRATCH:-$HOME}/fedtune}
source "${BASH_SOURCE[0]%/*}/_common.sh"

export OMP_NUM_THREADS=${OMP_NUM_THREADS:-7}  # 28 cores / 4 GPUs
