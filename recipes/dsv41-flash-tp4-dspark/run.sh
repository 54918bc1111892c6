#!/usr/bin/env bash
# Start, or roll out to, the TP4 DeepSeek-V4.1-Flash DSpark server from the pack's image (docker/Dockerfile).
#
#   MODEL_DIR=/srv/models/DeepSeek-V4.1-Flash recipes/dsv41-flash-tp4-dspark/run.sh
#
# Flags come from ENV_FILE (default adapters.env, via --env-file) and EXTRA_ENV, the server command is
# `python3 -m sglang.launch_server` with server.args and anything given to this script. A rollout stops
# at the first step that fails, with a non-zero status:
#   1. check  the new image with the new flags: `sglang-adapters doctor --strict` in a throw-away
#             container, before the running server is touched (its status: 78 a flag not understood,
#             69 refused). An image without the pack (IMAGE=lmsysorg/sglang:v0.5.23-cu130, the rollback
#             to the stock image) has nothing to check.
#   2. stop   the running container of the same NAME: SIGTERM, STOP_TIMEOUT seconds to finish, then
#             removed (docker stop -t).
#   3. start  the new one: restart policy and ulimits as upstream's docker/compose.yaml has them
#             (restart: always, memlock -1, stack 64 MiB), logs rotated (json-file, LOG_MAX_SIZE x LOG_MAX_FILE).
#   4. wait   for 200 from /health_generate (a one-token generation), START_TIMEOUT seconds for the model to
#             load. A container that exits or restarts meanwhile fails the rollout with its exit status (78,
#             69, the engine's own) and is stopped, its restart policy off, its logs kept (docker logs NAME).
#
#   GPUS          the four GPUs of TP4 (default device=0,1,2,3; e.g. GPUS=device=4,5,6,7)
#   DRAFT_DIR     host folder of the DSpark draft model when the checkpoint does not bundle it:
#                 mounted read-only at /models/draft and passed as --speculative-draft-model-path
#   EXTRA_ENV     one-off docker options for a rollout step, e.g. EXTRA_ENV="-e DSV41_ADAPTERS=off"
#                 (a later -e wins over --env-file)
#   IMAGE         the image; the whole rollback to the stock engine is IMAGE=lmsysorg/sglang:v0.5.23-cu130
#   NAME, PORT, STOP_TIMEOUT (60), START_TIMEOUT (1800), POLL (10), LOG_MAX_SIZE (100m), LOG_MAX_FILE (5)
set -euo pipefail
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)

IMAGE=${IMAGE:-sglang-dsv41:0.5.23-cu130-pack0.1.0}
MODEL_DIR=${MODEL_DIR:?set MODEL_DIR to the host folder that holds DeepSeek-V4.1-Flash}
DRAFT_DIR=${DRAFT_DIR:-}
NAME=${NAME:-dsv41-flash-tp4-dspark}
PORT=${PORT:-30000}
GPUS=${GPUS:-device=0,1,2,3}
ENV_FILE=${ENV_FILE:-$HERE/adapters.env}
STOP_TIMEOUT=${STOP_TIMEOUT:-60}
START_TIMEOUT=${START_TIMEOUT:-1800}
POLL=${POLL:-10}
HEALTH_URL=${HEALTH_URL:-http://127.0.0.1:$PORT/health_generate}
PACK_LABEL=io.github.sglang-dsv41.pack-version

mapfile -t SERVER_ARGS < <(grep -vE '^[[:space:]]*(#|$)' "$HERE/server.args")
MOUNTS=(-v "$MODEL_DIR:/models/DeepSeek-V4.1-Flash:ro")
if [ -n "$DRAFT_DIR" ]; then
  MOUNTS+=(-v "$DRAFT_DIR:/models/draft:ro")
  SERVER_ARGS+=(--speculative-draft-model-path=/models/draft)
fi
# shellcheck disable=SC2206  # EXTRA_ENV is a list of docker options, split on purpose
EXTRA=(${EXTRA_ENV:-})
ENV=(--env-file "$ENV_FILE" "${EXTRA[@]}")
say() { echo "run.sh: $*" >&2; }

# 1. check
docker image inspect "$IMAGE" >/dev/null 2>&1 || docker pull "$IMAGE" >/dev/null
pack=$(docker image inspect --format "{{index .Config.Labels \"$PACK_LABEL\"}}" "$IMAGE")
if [ -n "$pack" ] && [ "$pack" != "<no value>" ]; then
  status=0
  # judged for this very deployment: the server command, read with the engine's own parser
  docker run --rm "${ENV[@]}" "$IMAGE" doctor --strict -- python3 -m sglang.launch_server "${SERVER_ARGS[@]}" >&2 \
    || status=$?
  if [ "$status" -ne 0 ]; then
    say "doctor --strict refused the new image or flags (exit $status): the running server is untouched"
    exit "$status"
  fi
else
  say "$IMAGE carries no pack (no $PACK_LABEL label): nothing to check, the flags are ignored"
fi

# 2. stop
if docker container inspect "$NAME" >/dev/null 2>&1; then
  say "stopping $NAME (SIGTERM, ${STOP_TIMEOUT} s to finish)"
  docker stop -t "$STOP_TIMEOUT" "$NAME" >/dev/null
  docker rm "$NAME" >/dev/null
fi

# 3. start
docker run --detach --name "$NAME" \
  --gpus "\"$GPUS\"" --ipc=host --shm-size=32g \
  --restart always --ulimit memlock=-1 --ulimit stack=67108864 \
  --log-driver json-file --log-opt "max-size=${LOG_MAX_SIZE:-100m}" --log-opt "max-file=${LOG_MAX_FILE:-5}" \
  -p "$PORT:30000" \
  "${MOUNTS[@]}" \
  "${ENV[@]}" \
  "$IMAGE" python3 -m sglang.launch_server "${SERVER_ARGS[@]}" "$@" >/dev/null

# 4. wait
fail() {
  say "$1; stopping it (docker logs $NAME has the rest):"
  docker logs --tail 20 "$NAME" 2>&1 | sed 's/^/  /' >&2 || true
  docker update --restart=no "$NAME" >/dev/null || true
  docker stop -t "$STOP_TIMEOUT" "$NAME" >/dev/null || true
  exit "$2"
}
deadline=$((SECONDS + START_TIMEOUT))
started=$SECONDS
say "waiting up to ${START_TIMEOUT} s for 200 from $HEALTH_URL while the model loads (a line every ${POLL} s)"
while :; do
  read -r state code restarts < <(docker inspect --format '{{.State.Status}} {{.State.ExitCode}} {{.RestartCount}}' "$NAME")
  if [ "$restarts" -gt 0 ] || { [ "$state" != running ] && [ "$state" != created ]; }; then
    fail "the new container is $state, exit status $code, restarted $restarts times" "$([ "$code" -ne 0 ] && echo "$code" || echo 1)"
  fi
  if curl -fsS --max-time 60 -o /dev/null "$HEALTH_URL" 2>/dev/null; then
    say "$NAME is up: $HEALTH_URL answers 200"
    exit 0
  fi
  if [ "$SECONDS" -ge "$deadline" ]; then
    fail "no 200 from $HEALTH_URL within ${START_TIMEOUT} s" 1
  fi
  say "still waiting for $HEALTH_URL: $((SECONDS - started)) s of ${START_TIMEOUT} s, container $state"
  sleep "$POLL"
done
