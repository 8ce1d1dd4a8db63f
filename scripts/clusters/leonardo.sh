# Leonardo Booster (CINECA). Sourced by `scripts/launch --cluster leonardo` in every training task.
# Each setting keeps a value already exported (e.g. in ~/.bashrc or before running Snakemake).
# Compute nodes have no internet: everything is downloaded on the login node (download rules).

# Modules to load, space separated; empty with a venv or container that brings its own CUDA/NCCL
# (the PyTorch wheels do). Example: export FEDTUNE_MODULES="python/3.11.6--gcc--8.5.0 cuda/12.1"
if [[ -n ${FEDTUNE_MODULES:-} ]] && type module >/dev/null 2>&1; then module load $FEDTUNE_MODULES; fi

# Scratch ($SCRATCH; older docs: $CINECA_SCRATCH) holds the caches; $HOME is small and slow.
export FEDTUNE_SCRATCH=${FEDTUNE_SCRATCH:-${SCRATCH:-${CINECA_SCRATCH:-$HOME}}/fedtune}
source "${BASH_SOURCE[0]%/*}/_common.sh"

export NCCL_IB_TIMEOUT=${NCCL_IB_TIMEOUT:-22}
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-8}  # 32 cores / 4 GPUs
