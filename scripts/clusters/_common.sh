# Shared by the GPU clusters' files, sourced after they set FEDTUNE_SCRATCH (and NCCL_IB_TIMEOUT where
# the fabric wants it). Each setting keeps a value already exported.

# Caches on scratch: $HOME is small and slow, and compute nodes share scratch.
export HF_HOME=${HF_HOME:-$FEDTUNE_SCRATCH/hf-home}
export TORCH_EXTENSIONS_DIR=${TORCH_EXTENSIONS_DIR:-$FEDTUNE_SCRATCH/torch-extensions}
export TRITON_CACHE_DIR=${TRITON_CACHE_DIR:-$FEDTUNE_SCRATCH/triton}

# NCCL over InfiniBand, NVLink inside the node.
export NCCL_DEBUG=${NCCL_DEBUG:-WARN}
export NCCL_SOCKET_IFNAME=${NCCL_SOCKET_IFNAME:-^lo,docker0}
export TORCH_NCCL_ASYNC_ERROR_HANDLING=${TORCH_NCCL_ASYNC_ERROR_HANDLING:-1}

# SIGUSR1 to the training processes this many seconds before the job's time limit (scripts/launch): enough
# for a sharded 7B checkpoint (model + optimizer) on a parallel file system, with room to spare.
export FEDTUNE_SIGNAL_BEFORE=${FEDTUNE_SIGNAL_BEFORE:-300}
# With --software-deployment-method apptainer, each training process runs in the image with the host's
# NVIDIA driver (`apptainer exec --nv`); an AMD site sets rocm.
export FEDTUNE_CONTAINER_GPU=${FEDTUNE_CONTAINER_GPU:-nv}
