#!/usr/bin/env bash
# Start (or restart) the TP4 DeepSeek-V4.1-Flash DSpark server from the pack's image (docker/Dockerfile).
#
#   MODEL_DIR=/srv/models/DeepSeek-V4.1-Flash recipes/dsv41-flash-tp4-dspark/run.sh
#
# Flags come from ENV_FILE (default adapters.env, via --env-file), server arguments from
# server.args; anything given to this script is appended to the server arguments.
#   GPUS       the four GPUs of TP4 (default device=0,1,2,3; e.g. GPUS=device=4,5,6,7)
#   DRAFT_DIR  host folder of the DSpark draft model when the checkpoint does not bundle it:
#              mounted read-only at /models/draft and passed as --speculative-draft-model-path
#   EXTRA_ENV  one-off docker options for a rollout step, e.g. EXTRA_ENV="-e DSV41_ADAPTERS=off"
#              (a later -e wins over --env-file)
#   NAME, PORT, IMAGE
# A container of the same NAME is removed first (docker rm -f), so a restart with another env
# file is this same command.
set -euo pipefail
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)

IMAGE=${IMAGE:-sglang-dsv41:0.5.23-cu130-pack0.1.0}
MODEL_DIR=${MODEL_DIR:?set MODEL_DIR to the host folder that holds DeepSeek-V4.1-Flash}
DRAFT_DIR=${DRAFT_DIR:-}
NAME=${NAME:-dsv41-flash-tp4-dspark}
PORT=${PORT:-30000}
GPUS=${GPUS:-device=0,1,2,3}
ENV_FILE=${ENV_FILE:-$HERE/adapters.env}

mapfile -t SERVER_ARGS < <(grep -vE '^[[:space:]]*(#|$)' "$HERE/server.args")
MOUNTS=(-v "$MODEL_DIR:/models/DeepSeek-V4.1-Flash:ro")
if [ -n "$DRAFT_DIR" ]; then
  MOUNTS+=(-v "$DRAFT_DIR:/models/draft:ro")
  SERVER_ARGS+=(--speculative-draft-model-path=/models/draft)
fi
# shellcheck disable=SC2206  # EXTRA_ENV is a list of docker options, split on purpose
EXTRA=(${EXTRA_ENV:-})

set -x
docker rm -f "$NAME" >/dev/null 2>&1 || true
exec docker run --detach --name "$NAME" \
  --gpus "\"$GPUS\"" --ipc=host --shm-size=32g \
  -p "$PORT:30000" \
  "${MOUNTS[@]}" \
  --env-file "$ENV_FILE" "${EXTRA[@]}" \
  "$IMAGE" "${SERVER_ARGS[@]}" "$@"
