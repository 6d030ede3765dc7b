#!/usr/bin/env bash
# One rank of benchmarks/gpu_check_ranks.py under torchrun: a host of its own to NCCL, so that several ranks can
# share one GPU (NCCL refuses two ranks of one host on one GPU). Every rank is then local rank 0 of its host.
# Usage (by torchrun --no-python): gpu_rank.sh COMMAND ARGS...
set -euo pipefail
export NCCL_HOSTID="gpucheck-${GPU_CHECK_RUN:-run}-${RANK:?torchrun sets RANK}"
export LOCAL_RANK=0 LOCAL_WORLD_SIZE=1
exec "$@"
