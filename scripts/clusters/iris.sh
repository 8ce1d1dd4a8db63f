# Iris (ULHPC). Sourced by `scripts/launch --cluster iris` in every training task.
# Each setting keeps a value already exported (e.g. in ~/.bashrc or before running Snakemake).

# Modules (FEDTUNE_MODULES, loaded by _common.sh; none is needed with the venv's PyPI wheels, which bring
# their own CUDA and NCCL). ULHPC's module names, not verified on a GPU node:
#   export FEDTUNE_MODULES="lang/Python system/CUDA"

# V100 GPUs have no bf16. The trainer refuses precision bf16 when FEDTUNE_NO_BF16=1 (use fp16, which
# trains with loss scaling, or fp32) instead of failing or silently emulating it.
export FEDTUNE_NO_BF16=1

export FEDTUNE_SCRATCH=${FEDTUNE_SCRATCH:-${SCRATCH:-$HOME}/fedtune}
source "${BASH_SOURCE[0]%/*}/_common.sh"

export OMP_NUM_THREADS=${OMP_NUM_THREADS:-7}  # 28 cores / 4 GPUs
