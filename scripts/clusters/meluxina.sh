# MeluXina (LuxProvide). Sourced by `scripts/launch --cluster meluxina` in every training task.
# Each setting keeps a value already exported (e.g. in ~/.bashrc or before running Snakemake).

# Modules to load, space separated; empty with a venv or container that brings its own CUDA/NCCL
# (the PyTorch wheels do). Example: export FEDTUNE_MODULES="env/release/2023.1 Python CUDA"
if [[ -n ${FEDTUNE_MODULES:-} ]] && type module >/dev/null 2>&1; then module load $FEDTUNE_MODULES; fi

# Project scratch: /project/scratch/<account> (accounts are pNNNNNN).
# The same account as the profile's (FEDTUNE_MELUXINA_ACCOUNT, else FEDTUNE_ACCOUNT; the jobs inherit
# both), else Slurm's, which the mpi job path clears. An empty one would put every task's caches under
# /project/scratch//fedtune.
_fedtune_project=${FEDTUNE_MELUXINA_ACCOUNT:-${FEDTUNE_ACCOUNT:-${SLURM_JOB_ACCOUNT:-}}}
if [[ -z ${FEDTUNE_SCRATCH:-} && -z $_fedtune_project ]]; then
    echo "scripts/clusters/meluxina.sh: no project for the scratch path /project/scratch/<project>/fedtune:" \
        "export FEDTUNE_ACCOUNT (or FEDTUNE_MELUXINA_ACCOUNT), or FEDTUNE_SCRATCH" >&2
    unset _fedtune_project
    return 2
fi
export FEDTUNE_SCRATCH=${FEDTUNE_SCRATCH:-/project/scratch/$_fedtune_project/fedtune}
unset _fedtune_project
source "${BASH_SOURCE[0]%/*}/_common.sh"

export NCCL_IB_TIMEOUT=${NCCL_IB_TIMEOUT:-22}
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-16}  # 64 cores / 4 GPUs
