# The local test cluster (scripts/slurm-local): nodes n1 and n2 are the same machine, no GPU.
# Sourced by `scripts/launch --cluster slurm-local` in every training task. It sources no _common.sh: no
# GPU site (fedtune/core/clusters.py: site_clusters), so the default torch build.

# Both "nodes" are this host: gloo talks over the loopback interface.
export GLOO_SOCKET_IFNAME=${GLOO_SOCKET_IFNAME:-lo}
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
export TOKENIZERS_PARALLELISM=${TOKENIZERS_PARALLELISM:-false}

# Short limits in the tests: SIGUSR1 a minute before the time limit; no GPU for a container.
export FEDTUNE_SIGNAL_BEFORE=${FEDTUNE_SIGNAL_BEFORE:-60}
export FEDTUNE_CONTAINER_GPU=${FEDTUNE_CONTAINER_GPU:-none}
