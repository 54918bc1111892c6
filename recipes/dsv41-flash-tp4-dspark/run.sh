#!/usr/bin/env bash
# Start the TP4 DeepSeek-V4.1-Flash DSpark server from the pack's image (docker/Dockerfile).
#
#   MODEL_DIR=/srv/models/DeepSeek-V4.1-Flash recipes/dsv41-flash-tp4-dspark/run.sh
#
# Flags come from adapters.env (--env-file), server arguments from server.args; anything
# given to this script is appended to the server arguments. One-off flag changes for a
# rollout step: EXTRA_ENV="-e DSV41_FOLDED_FENCE=0" (a later -e wins over --env-file).
set -euo pipefail
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)

IMAGE=${IMAGE:-sglang-dsv41:0.5.23-cu130-pack0.1.0}
MODEL_DIR=${MODEL_DIR:?set MODEL_DIR to the host folder that holds DeepSeek-V4.1-Flash}
NAME=${NAME:-dsv41-flash-tp4-dspark}
PORT=${PORT:-30000}
# Four GPUs for TP4, e.g. GPUS='"device=0,1,2,3"' on an eight-GPU host.
GPUS=${GPUS:-all}

mapfile -t SERVER_ARGS < <(grep -vE '^[[:space:]]*(#|$)' "$HERE/server.args")
# shellcheck disable=SC2206  # EXTRA_ENV is a list of docker options, split on purpose
EXTRA=(${EXTRA_ENV:-})

set -x
exec docker run --detach --name "$NAME" \
  --gpus "$GPUS" --ipc=host --shm-size=32g \
  -p "$PORT:30000" \
  -v "$MODEL_DIR:/models/DeepSeek-V4.1-Flash:ro" \
  --env-file "$HERE/adapters.env" "${EXTRA[@]}" \
  "$IMAGE" "${SERVER_ARGS[@]}" "$@"
