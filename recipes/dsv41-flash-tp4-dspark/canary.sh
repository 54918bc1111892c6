#!/usr/bin/env bash
# Canary check from the engine's own Prometheus metrics (server.args has --enable-metrics and
# --enable-metrics-for-all-schedulers, so every TP rank exports its own series).
#
#   recipes/dsv41-flash-tp4-dspark/canary.sh [BASELINE_URL] CANARY_URL
#   recipes/dsv41-flash-tp4-dspark/canary.sh http://baseline:30000 http://canary:30000
#
# For DURATION seconds (default 1800) it reads /metrics every INTERVAL seconds (default 15) and
# judges the canary on what a divergence breaks:
#   accept length   delta of sglang:generation_tokens_total over delta of sglang:spec_verify_calls_total
#                   (tokens per verify step over the window, per rank where the counters carry a tp_rank;
#                   0.5.16-0.5.23 count them once per server, in the tokenizer), at least ACCEPT_FLOOR.
#                   ACCEPT_FLOOR defaults to 3.0; its reference is the published golden accept length of
#                   DeepSeek-V4.1-Flash with DSpark at TP4, block 5, thinking on: 3.51. Set it from your own
#                   traffic (a baseline's figure) when that differs.
#   ranks agree     each TP rank's decode tokens (delta of sglang:realtime_tokens_total{mode="decode"}) and
#                   mean sglang:spec_accept_length within RANK_TOLERANCE (default 0.02, relative) of rank 0's,
#                   from EXPECT_RANKS ranks (default 4): ranks that commit different token counts diverge.
#   progress        no rank's decode tokens stand still for STALL_SECONDS (default 60) while requests
#                   are running or queued (sglang:num_running_reqs + sglang:num_queue_reqs): a wedged rank
#                   can still answer /health with 200.
# With a baseline (the same traffic, split evenly, the pack off: the rollback state) also:
#   the canary's accept length at least ACCEPT_MIN (default 0.98) of the baseline's (the fence copies
#   results, it changes no decision) and its generated tokens per second at least RATE_MIN (0.97) of it.
# Prints one line per finding and `canary PASS` or `canary FAIL`; exits 0 on PASS, 1 on FAIL.
set -euo pipefail
if [ $# -eq 1 ]; then BASE="" CANARY=$1; else BASE=${1:?usage: canary.sh [BASELINE_URL] CANARY_URL} CANARY=${2:?usage: canary.sh [BASELINE_URL] CANARY_URL}; fi
DURATION=${DURATION:-1800}
INTERVAL=${INTERVAL:-15}
ACCEPT_FLOOR=${ACCEPT_FLOOR:-3.0}
RANK_TOLERANCE=${RANK_TOLERANCE:-0.02}
EXPECT_RANKS=${EXPECT_RANKS:-4}
STALL_SECONDS=${STALL_SECONDS:-60}
ACCEPT_MIN=${ACCEPT_MIN:-0.98}
RATE_MIN=${RATE_MIN:-0.97}
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT

# sample URL FILE: appends "<seconds> <what> <rank> <value>" for the series the verdict reads,
# summed over every other label (is_streaming, ...); rank "-" for a series without tp_rank.
sample() {
  local text
  text=$(curl -fsS --max-time 10 "$1/metrics") || { echo "canary.sh: cannot read $1/metrics (is the server up?)" >&2; exit 1; }
  # The read's time to the microsecond where bash has it (5.0+): whole seconds would make two servers read
  # one after the other straddle a second and differ by a second over a short window.
  awk -v t="${EPOCHREALTIME:-$SECONDS}" '
    /^#/ { next }
    {
      name = $1; sub(/\{.*/, "", name)
      rank = "-"; if (match($1, /tp_rank="[^"]*"/)) rank = substr($1, RSTART + 9, RLENGTH - 10)
      what = ""
      if (name == "sglang:generation_tokens_total") what = "tokens"
      else if (name == "sglang:spec_verify_calls_total") what = "verify"
      else if (name == "sglang:realtime_tokens_total" && $1 ~ /mode="decode"/) what = "decode"
      else if (name == "sglang:spec_accept_length") what = "accept"
      else if (name == "sglang:num_running_reqs" || name == "sglang:num_queue_reqs") what = "busy"
      if (what != "") sum[what " " rank] += $NF
    }
    END { for (key in sum) print t, key, sum[key] }' <<< "$text" >> "$2"
}

end=$((SECONDS + DURATION))
while :; do
  [ -n "$BASE" ] && sample "$BASE" "$WORK/base"
  sample "$CANARY" "$WORK/canary"
  [ "$SECONDS" -ge "$end" ] && break
  sleep "$INTERVAL"
done

# judge FILE: the findings on one server's samples, one per line, "FAIL ..." or "ok ..."; the last
# line "figures ACCEPT RATE" for the comparison with the baseline.
judge() {
  sort -n -s -k1,1 "$1" | awk -v floor="$ACCEPT_FLOOR" -v tol="$RANK_TOLERANCE" -v ranks="$EXPECT_RANKS" \
      -v stall="$STALL_SECONDS" '
    function abs(x) { return x < 0 ? -x : x }
    {
      t = $1; what = $2; r = $3; v = $4; key = what " " r
      if (!(key in first)) first[key] = v
      last[key] = v; t_last = t; if (t_first == "") t_first = t
      if (what == "accept") { acc[r] += v; accn[r]++ }
      if (what == "decode") {
        seen[r] = 1
        # a stall: this rank decoded nothing since its last sample while requests were waiting then
        if ((r in prev) && v == prev[r] && busy_prev[r] > 0) { if (!(r in since)) since[r] = prev_t[r] }
        else delete since[r]
        if ((r in since) && t - since[r] >= stall && !(r in stalled)) stalled[r] = t - since[r]
        prev[r] = v; prev_t[r] = t; busy_prev[r] = busy[r]
      }
      if (what == "busy") busy[r] = v
    }
    END {
      window = t_last - t_first
      # accept length from the counters, per rank where they carry one
      n = 0
      for (key in last) if (key ~ /^tokens /) {
        split(key, k, " "); dt = last[key] - first[key]; dv = last["verify " k[2]] - first["verify " k[2]]
        if (dv <= 0) { print "FAIL no speculative verify steps counted over " int(window) " s (" k[2] "): no traffic, or not DSpark"; bad = 1; continue }
        a = dt / dv; tokens += dt; verify += dv; n++
        printf "%s accept length %.3f (rank %s: %d tokens / %d verify steps), floor %.2f (reference 3.51)\n", (a >= floor ? "ok" : "FAIL"), a, k[2], dt, dv, floor
        if (a < floor) bad = 1
      }
      if (!n) { print "FAIL no sglang:generation_tokens_total (start the server with --enable-metrics)"; bad = 1 }
      # every rank, and each like rank 0
      count = 0; for (r in seen) count++
      if (count < ranks) { printf "FAIL %d of %d ranks export decode tokens (--enable-metrics-for-all-schedulers)\n", count, ranks; bad = 1 }
      d0 = last["decode 0"] - first["decode 0"]; a0 = accn[0] ? acc[0] / accn[0] : 0
      for (r in seen) {
        d = last["decode " r] - first["decode " r]; a = accn[r] ? acc[r] / accn[r] : 0
        off = (abs(d - d0) > tol * (d0 > 0 ? d0 : 1)) || (abs(a - a0) > tol * (a0 > 0 ? a0 : 1))
        printf "%s rank %s: %d decode tokens, mean spec_accept_length %.3f (rank 0: %d, %.3f)\n", (off ? "FAIL" : "ok"), r, d, a, d0, a0
        if (off) bad = 1
        if (r in stalled) { printf "FAIL rank %s decoded nothing for %d s while requests were running or queued\n", r, stalled[r]; bad = 1 }
      }
      printf "figures %.6f %.6f\n", (verify > 0 ? tokens / verify : 0), (window > 0 ? tokens / window : 0)
      exit bad }'
}

status=0
canary_out=$(judge "$WORK/canary") || status=1
grep -v '^figures ' <<< "$canary_out" | sed 's/^/canary: /'
read -r _ accept_canary rate_canary < <(grep '^figures ' <<< "$canary_out")
if [ -n "$BASE" ]; then
  base_out=$(judge "$WORK/base") || true
  read -r _ accept_base rate_base < <(grep '^figures ' <<< "$base_out")
  awk -v ab="$accept_base" -v ac="$accept_canary" -v rb="$rate_base" -v rc="$rate_canary" -v amin="$ACCEPT_MIN" \
      -v rmin="$RATE_MIN" 'BEGIN {
    ok = ab > 0 && rb > 0 && ac >= amin * ab && rc >= rmin * rb
    printf "canary: %s against the baseline: accept length %.3f vs %.3f (min %.2fx), tokens/s %.1f vs %.1f (min %.2fx)\n",
           ok ? "ok" : "FAIL", ac, ab, amin, rc, rb, rmin
    exit ok ? 0 : 1 }' || status=1
fi
if [ "$status" -eq 0 ]; then echo "canary PASS"; else echo "canary FAIL"; fi
exit "$status"
