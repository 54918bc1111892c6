#!/usr/bin/env bash
# The test suite's wall time from fresh clones, one revision after the other on this machine:
#
#   bash bench/suite_time.sh OUT.json REV [REV ...]
#   SUITE_LOAD=1 bash bench/suite_time.sh OUT.json REV [REV ...]     (loaded)
#
# Each revision is cloned from this repository into a new folder, set up with its own
# scripts/setup.sh (timed apart), then its README test command `bash scripts/test.sh` is timed
# (what CI runs). The logs stay beside OUT; OUT gets one JSON record per revision.
# Loaded: while the test command runs, one CPU-burning process per core runs beside it (a laptop
# or a CI runner with busy neighbours); they are stopped when it ends.
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
OUT=$(realpath -m "$1")
shift
[ $# -ge 1 ] || { echo "usage: bash bench/suite_time.sh OUT.json REV [REV ...]" >&2; exit 64; }
WORK=$(mktemp -d)
LOGS="${OUT%.json}-logs"
mkdir -p "$LOGS"
records=()
LOAD=${SUITE_LOAD:-0}
burners=()
stop_burners() { for pid in "${burners[@]}"; do kill "$pid" 2>/dev/null || true; done; burners=(); }
trap stop_burners EXIT
for rev in "$@"; do
  sha=$(git -C "$ROOT" rev-parse --short "$rev")
  clone="$WORK/$sha"
  git clone -q "$ROOT" "$clone"
  git -C "$clone" checkout -q "$sha"
  echo "suite_time: $sha set up in $clone" >&2
  t0=$(date +%s)
  (cd "$clone" && bash scripts/setup.sh) > "$LOGS/$sha-setup.log" 2>&1
  t1=$(date +%s)
  status=0
  if [ "$LOAD" = 1 ]; then
    for _ in $(seq "$(nproc)"); do sh -c 'while :; do :; done' & burners+=($!); done
  fi
  load_before=$(cut -d' ' -f1 /proc/loadavg)
  (cd "$clone" && bash scripts/test.sh) > "$LOGS/$sha-test.log" 2>&1 || status=$?
  t2=$(date +%s)
  load_after=$(cut -d' ' -f1-3 /proc/loadavg)
  stop_burners
  summary=$(grep -E "^=+ .*(passed|failed).* in " "$LOGS/$sha-test.log" | tail -1 | tr -d '=' | sed 's/^ *//; s/ *$//')
  echo "suite_time: $sha setup $((t1 - t0)) s, tests $((t2 - t1)) s, exit $status: $summary" >&2
  records+=("{\"revision\": \"$sha\", \"setup_s\": $((t1 - t0)), \"test_command_s\": $((t2 - t1)), \"exit\": $status, \"pytest\": \"$summary\", \"burners\": $([ "$LOAD" = 1 ] && nproc || echo 0), \"loadavg_start\": \"$load_before\", \"loadavg_end_1_5_15\": \"$load_after\"}")
  rm -rf "$clone"
done
{
  echo "{\"machine\": \"$(nproc) cores, $(free -g | awk '/Mem:/ {print $2}') GB\", \"command\": \"bash scripts/test.sh\", \"runs\": ["
  (IFS=,; echo "${records[*]}")
  echo "]}"
} > "$OUT"
cat "$OUT"
