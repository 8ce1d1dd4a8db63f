# Karolina (IT4I). Sourced by `scripts/launch --cluster karolina` in every training task.
# Each setting keeps a value already exported (e.g. in ~/.bashrc or before running Snakemake).

# Modules (FEDTUNE_MODULES, loaded by _common.sh; none is needed with the venv's PyPI wheels, which bring
# their own CUDA and NCCL). No published module line for Karolina's GPU nodes was found (the xFFL project
# runs there in Apptainer with none); an EasyBuild-style example, not verified:
#   export FEDTUNE_MODULES="Python/3.11.3-GCCcore-12.3.0 CUDA/12.1.1"

# Project scratch: /scratch/project/<project id, lower case>; the id is the Slurm account.
# The same account as the profile's (FEDTUNE_KAROLINA_ACCOUNT, else FEDTUNE_ACCOUNT; the jobs inherit
# both), else Slurm's, which the mpi job path clears. An empty one would put every task's caches under
# /scratch/project//fedtune.
_fedtune_project=${FEDTUNE_KAROLINA_ACCOUNT:-${FEDTUNE_ACCOUNT:-${SLURM_JOB_ACCOUNT:-}}}
if [[ -z ${FEDTUNE_SCRATCH:-} && -z $_fedtune_project ]]; then
    echo "scripts/clusters/karolina.sh: no project for the scratch path /scratch/project/<project>/fedtune:" \
        "export FEDTUNE_ACCOUNT (or FEDTUNE_KAROLINA_ACCOUNT), or FEDTUNE_SCRATCH" >&2
    unset _fedtune_project
    return 2
fi
export FEDTUNE_SCRATCH=${FEDTUNE_SCRATCH:-/scratch/project/${_fedtune_project,,}/fedtune}
unset _fedtune_project
source "${BASH_SOURCE[0]%/*}/_common.sh"

export NCCL_IB_TIMEOUT=${NCCL_IB_TIMEOUT:-22}
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-16}  # 128 cores / 8 GPUs
