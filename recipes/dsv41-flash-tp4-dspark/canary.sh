#!/usr/bin/env bash
# Canary check: one replica with the new flags against one without, same traffic, from the
# engine's own Prometheus metrics (server.args has --enable-metrics).
#
#   recipes/dsv41-flash-tp4-dspark/canary.sh http://baseline:30000 http://canary:30000
#
# For DURATION seconds (default 1800) it reads both /metrics every INTERVAL seconds (default 15):
#   sglang:spec_accept_length        mean accepted drafts + bonus per verify step (gauge; mean of samples)
#   sglang:generation_tokens_total   generated tokens (counter; its increase / DURATION = tokens per second)
# Pass (exit 0): the canary's accept length is at least ACCEPT_MIN (default 0.98) of the baseline's
# (the fence copies results, it changes no decision) and its token rate at least RATE_MIN (default
# 0.97) of the baseline's (the fence costs microseconds per verify step). Else exit 1 with the figures.
# Split the traffic evenly between the two replicas for the whole window.
set -euo pipefail
BASE=${1:?usage: canary.sh BASELINE_URL CANARY_URL}
CANARY=${2:?usage: canary.sh BASELINE_URL CANARY_URL}
DURATION=${DURATION:-1800}
INTERVAL=${INTERVAL:-15}
ACCEPT_MIN=${ACCEPT_MIN:-0.98}
RATE_MIN=${RATE_MIN:-0.97}

# metric URL NAME: the sum over the metric's series (every TP rank and label set).
metric() {
  local text
  text=$(curl -fsS --max-time 10 "$1/metrics") || { echo "canary.sh: cannot read $1/metrics (is the server up?)" >&2; return 1; }
  awk -v name="$2" \
    'index($0, name "{") == 1 || index($0, name " ") == 1 { sum += $NF; n++ } END { if (!n) exit 1; print sum / (name ~ /_total$/ ? 1 : n) }' \
    <<< "$text" || { echo "canary.sh: $1/metrics has no $2 (start the server with --enable-metrics)" >&2; return 1; }
}

start_base=$(metric "$BASE" sglang:generation_tokens_total)
start_canary=$(metric "$CANARY" sglang:generation_tokens_total)
accept_base=0 accept_canary=0 samples=0
end=$((SECONDS + DURATION))
while [ "$SECONDS" -lt "$end" ]; do
  sleep "$INTERVAL"
  accept_base=$(awk -v a="$accept_base" -v b="$(metric "$BASE" sglang:spec_accept_length)" 'BEGIN { print a + b }')
  accept_canary=$(awk -v a="$accept_canary" -v b="$(metric "$CANARY" sglang:spec_accept_length)" 'BEGIN { print a + b }')
  samples=$((samples + 1))
done
rate_base=$(awk -v a="$start_base" -v b="$(metric "$BASE" sglang:generation_tokens_total)" -v t="$DURATION" 'BEGIN { print (b - a) / t }')
rate_canary=$(awk -v a="$start_canary" -v b="$(metric "$CANARY" sglang:generation_tokens_total)" -v t="$DURATION" 'BEGIN { print (b - a) / t }')

awk -v ab="$accept_base" -v ac="$accept_canary" -v n="$samples" -v rb="$rate_base" -v rc="$rate_canary" \
    -v amin="$ACCEPT_MIN" -v rmin="$RATE_MIN" 'BEGIN {
  ab /= n; ac /= n
  ok = ab > 0 && rb > 0 && ac >= amin * ab && rc >= rmin * rb
  printf "canary %s: spec_accept_length %.3f vs %.3f (min %.2fx), tokens/s %.1f vs %.1f (min %.2fx), %d samples\n",
         ok ? "PASS" : "FAIL", ac, ab, amin, rc, rb, rmin, n
  exit ok ? 0 : 1 }'
