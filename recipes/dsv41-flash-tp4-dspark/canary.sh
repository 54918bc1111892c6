#!/usr/bin/env bash
# The canary verdict: a thin caller of the pack's `sglang-adapters canary` (its --help says what it
# judges; README.md "Rollout, canary, rollback" shows its output).
#
#   recipes/dsv41-flash-tp4-dspark/canary.sh [BASELINE_URL] CANARY_URL [-- MORE-FLAGS...]
#   recipes/dsv41-flash-tp4-dspark/canary.sh http://localhost:30001 http://localhost:30002 -- --json
#
# The environment names of the earlier script become its flags: DURATION (--window, default 1800),
# INTERVAL (--interval, 15), ACCEPT_FLOOR (--accept-floor, 3.0), RANK_TOLERANCE (--rank-tolerance, 0.02),
# EXPECT_RANKS (--ranks, 4), STALL_SECONDS (--stall, 60), ACCEPT_MIN (--accept-min, 0.98),
# RATE_MIN (--rate-min, 0.97). The command is SGLANG_ADAPTERS when set, else `sglang-adapters` where it
# is installed, else the image's (IMAGE) on the host's network. Exit status: the command's (0 PASS,
# 1 FAIL, 3 INCONCLUSIVE: too little compared to judge, never a pass, 64 a bad flag, 75 a server that did
# not answer at the start); only 0 widens the rollout. In a cluster: k8s/analysistemplate.yaml.
set -euo pipefail
urls=()
while [ $# -gt 0 ] && [ "$1" != "--" ]; do urls+=("$1"); shift; done
[ $# -gt 0 ] && shift  # the --
case ${#urls[@]} in
  1) servers=(--canary "${urls[0]}") ;;
  2) servers=(--baseline "${urls[0]}" --canary "${urls[1]}") ;;
  *) echo "usage: canary.sh [BASELINE_URL] CANARY_URL [-- MORE-FLAGS...]" >&2; exit 64 ;;
esac
IMAGE=${IMAGE:-sglang-dsv41:0.5.23-cu130-pack0.1.0}
if [ -n "${SGLANG_ADAPTERS:-}" ]; then
  read -ra command <<< "$SGLANG_ADAPTERS"
elif command -v sglang-adapters > /dev/null; then
  command=(sglang-adapters)
else
  command=(docker run --rm --network host "$IMAGE")
fi
flags=()
for pair in DURATION:--window INTERVAL:--interval ACCEPT_FLOOR:--accept-floor RANK_TOLERANCE:--rank-tolerance \
            EXPECT_RANKS:--ranks STALL_SECONDS:--stall ACCEPT_MIN:--accept-min RATE_MIN:--rate-min; do
  name=${pair%%:*}
  if [ -n "${!name:-}" ]; then flags+=("${pair#*:}" "${!name}"); fi
done
exec "${command[@]}" canary "${servers[@]}" ${flags[@]+"${flags[@]}"} "$@"
