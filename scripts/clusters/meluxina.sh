# MeluXina (LuxProvide). Sourced by `scripts/launch --cluster meluxina` in every training task.
# Each setting keeps a value already exported (e.g. in ~/.bashrc or before running Snakemake).

# Modules (FEDTUNE_MODULES, loaded by _common.sh; none is needed with the venv's PyPI wheels, which bring
# their own CUDA and NCCL). These load on the GPU nodes in published multi-node runs (alpha-unito/xffl,
# xffl/workflow/scripts/facilities/meluxina.sh, read 2026-11-27):
#   export FEDTUNE_MODULES="Python/3.11.10-GCCcore-13.3.0"

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
