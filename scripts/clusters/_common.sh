# Shared by the GPU clusters' files, sourced after they set FEDTUNE_SCRATCH (and their NCCL settings).
# Each setting keeps a value already exported. A cluster file that sources this is a GPU site: the list of
# sites is read from that line (fedtune/core/clusters.py: site_clusters; scripts/setup-env).

# Modules (FEDTUNE_MODULES, space separated; each cluster's file names the ones known to load there as a
# commented default). Empty with a venv or container that brings its own CUDA/NCCL (the PyTorch wheels do).
# A batch shell may lack the `module` function that login shells define: Lmod's or Environment Modules'
# init script is sourced then; where there is none, the modules are not loaded and this says so.
if [[ -n ${FEDTUNE_MODULES:-} ]]; then
    if ! type module >/dev/null 2>&1 && [[ -n ${MODULESHOME:-} && -f $MODULESHOME/init/bash ]]; then
        # shellcheck disable=SC1091
        source "$MODULESHOME/init/bash"
    fi
    if ! type module >/dev/null 2>&1; then
        echo "scripts/clusters: warning: FEDTUNE_MODULES=\"$FEDTUNE_MODULES\" but this shell has no \`module\`" \
            "command (no Lmod / Environment Modules init): the modules are NOT loaded" >&2
    elif ! module load $FEDTUNE_MODULES; then
        echo "scripts/clusters: \`module load $FEDTUNE_MODULES\` failed: fix FEDTUNE_MODULES" \
            "(\`module avail\` on the login node lists what exists)" >&2
        return 2
    fi
fi

# Caches on scratch: $HOME is small and slow, and compute nodes share scratch.
export HF_HOME=${HF_HOME:-$FEDTUNE_SCRATCH/hf-home}
export TORCH_EXTENSIONS_DIR=${TORCH_EXTENSIONS_DIR:-$FEDTUNE_SCRATCH/torch-extensions}
export TRITON_CACHE_DIR=${TRITON_CACHE_DIR:-$FEDTUNE_SCRATCH/triton}

# Log lines reach the job's log as they are written, not when a buffer fills (or never, when the job is
# killed at its time limit).
export PYTHONUNBUFFERED=${PYTHONUNBUFFERED:-1}

# Open files: sharded checkpoints, Arrow shards, NCCL's and the data loaders' sockets and pipes add up past
# the common soft limit of 1024. Raised to FEDTUNE_NOFILE (131072, as published Leonardo runs set it) or
# the hard limit when that is lower; tasks started by srun inherit it.
_fedtune_hard=$(ulimit -Hn)
_fedtune_want=${FEDTUNE_NOFILE:-131072}
if [[ $_fedtune_hard != unlimited ]] && ((_fedtune_hard < _fedtune_want)); then _fedtune_want=$_fedtune_hard; fi
if [[ $(ulimit -Sn) != unlimited ]] && (($(ulimit -Sn) < _fedtune_want)); then
    ulimit -Sn "$_fedtune_want" || echo "scripts/clusters: warning: could not raise the open-files limit" \
        "from $(ulimit -Sn) to $_fedtune_want" >&2
fi
unset _fedtune_hard _fedtune_want

# The GPUs a process sees: Slurm sets CUDA_VISIBLE_DEVICES for each step from its GPU binding, and that is
# kept. What is no choice of GPUs is dropped (the process then sees what its cgroup allows): an empty
# value (no GPU at all), or Slurm's "NoDevFiles" (GPUs declared without device files).
if [[ ${CUDA_VISIBLE_DEVICES+set} == set ]]; then
    case $CUDA_VISIBLE_DEVICES in
        "" | NoDevFiles)
            echo "scripts/clusters: CUDA_VISIBLE_DEVICES=\"$CUDA_VISIBLE_DEVICES\" names no GPU: unset" >&2
            unset CUDA_VISIBLE_DEVICES
            ;;
    esac
fi

# NCCL over InfiniBand (all four sites' GPU nodes), NVLink inside the node; the cluster's file adds what
# its fabric wants before this.
export NCCL_IB_DISABLE=${NCCL_IB_DISABLE:-0}
export NCCL_DEBUG=${NCCL_DEBUG:-WARN}
export NCCL_SOCKET_IFNAME=${NCCL_SOCKET_IFNAME:-^lo,docker0}
export TORCH_NCCL_ASYNC_ERROR_HANDLING=${TORCH_NCCL_ASYNC_ERROR_HANDLING:-1}

# SIGUSR1 to the training processes this many seconds before the job's time limit (scripts/launch): enough
# for a sharded 7B checkpoint (model + optimizer) on a parallel file system, with room to spare.
export FEDTUNE_SIGNAL_BEFORE=${FEDTUNE_SIGNAL_BEFORE:-300}
# With --software-deployment-method apptainer, each training process runs in the image with the host's
# NVIDIA driver (`apptainer exec --nv`); an AMD site sets rocm.
export FEDTUNE_CONTAINER_GPU=${FEDTUNE_CONTAINER_GPU:-nv}
