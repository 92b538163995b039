#!/usr/bin/env bash
# The main job. With GPUs: torchrun over all of them (8 on the record machine) with the speedrun
# preset. Without: the smoke preset in one process on the bundled corpus. Arguments pass through,
# e.g. ./run.sh --num_iterations=100 --val_loss_every=50
set -euo pipefail
cd "$(dirname "$0")"
PYTHON=${PYTHON:-python3}
if ! gpus=$("$PYTHON" -c "import torch; print(torch.cuda.device_count())" 2>/dev/null); then
  echo "error: $PYTHON cannot import torch; install it first (README, Quick start), or set PYTHON to an interpreter that has it" >&2
  exit 1
fi
if [ "$gpus" -gt 0 ]; then
  exec "$PYTHON" -m torch.distributed.run --standalone --nproc_per_node="$gpus" train_gpt.py "$@"
fi
exec "$PYTHON" train_gpt.py "$@"
