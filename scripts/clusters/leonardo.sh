# Leonardo Booster (CINECA). Sourced by `scripts/launch --cluster leonardo` in every training task.
# Each setting keeps a value already exported (e.g. in ~/.bashrc or before running Snakemake).
# Compute nodes have no internet: everything is downloaded on the login node (download rules).

# Modules (FEDTUNE_MODULES, loaded by _common.sh; none is needed with the venv's PyPI wheels, which bring
# their own CUDA and NCCL). These load on the Booster in published multi-node runs (alpha-unito/xffl,
# xffl/workflow/scripts/facilities/leonardo.sh, read 2026-11-27); `module avail` tells what is there today:
#   export FEDTUNE_MODULES="cuda/12.2 nccl/2.22.3-1--gcc--12.2.0-cuda-12.2-spack0.22"

# Scratch ($SCRATCH; older docs: $CINECA_SCRATCH) holds the caches; $HOME is small and slow.
export FEDTUNE_SCRATCH=${FEDTUNE_SCRATCH:-${SCRATCH:-${CINECA_SCRATCH:-$HOME}}/fedtune}
# NCCL on the Booster's InfiniBand (as published multi-node runs set it, alpha-unito/xffl, read 2026-11-27):
# GPUDirect RDMA where GPU and NIC share PCIe switches (level 2 = PXB), peer-to-peer between any two of the
# node's GPUs (SYS). NCCL_IB_DISABLE=0 (_common.sh) as there.
export NCCL_NET_GDR_LEVEL=${NCCL_NET_GDR_LEVEL:-2}
export NCCL_P2P_LEVEL=${NCCL_P2P_LEVEL:-SYS}
export NCCL_IB_TIMEOUT=${NCCL_IB_TIMEOUT:-22}
source "${BASH_SOURCE[0]%/*}/_common.sh"

export OMP_NUM_THREADS=${OMP_NUM_THREADS:-8}  # 32 cores / 4 GPUs
