"""The report's site 30:pack-decode-graph-key (DSV41_TP_DIVERGENCE) at TP 2 on gloo: injected
skews counted with the report off and on, and its cost per decode step beside the bare collective.

    python bench/graph_key_cost.py [--json OUT] [--steps 180] [--reps 7] [--cost-steps 300]

Two processes joined by a real gloo group (harness.ranks), sglang 0.5.23, each decode step
the real ModelRunner._forward_raw / DecodeCudaGraphRunner.can_run_graph / execute / load_batch
on the state they read (tests/graph_key_cases.py). Table 1: skews on rank 1 (a batch that pads
to another graph key, or one too large for any graph: eager), 60 of `--steps` steps per kind,
the calls counted as diverged on rank 1 with the report off and on, and with no skew. Table 2:
host time per decode step (us, median of --reps), the forward with the report off and on, and
the bare collective (one int64 broadcast on the same GroupCoordinator). CPU only: on a GPU the
compare is one fill, one copy, the broadcast and the report's fused comparison per step
(bench/divergence_cost.py measures the comparison).
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from harness.ranks import run_ranks  # noqa: E402

SITE = "30:pack-decode-graph-key"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json")
    parser.add_argument("--steps", type=int, default=180)
    parser.add_argument("--reps", type=int, default=7)
    parser.add_argument("--cost-steps", type=int, default=300)
    opts = parser.parse_args(argv)
    skews = {"tier": list(range(0, opts.steps, 3))[:60], "eager": list(range(1, opts.steps, 3))[:60]}
    ranks = run_ranks(2, "tests.graph_key_cases:graph_key_case", release="0.5.23", timeout=600,
                      kwargs={"n": opts.steps, "skews": [[None, []], *([k, v] for k, v in skews.items())]})
    rows = []
    print(f"site {SITE}, TP 2 gloo, sglang 0.5.23, {opts.steps} decode steps per run; diverged calls counted on rank 1 "
          "(rank 0)")
    print(f"{'skew':<8}{'cases':>7}{'keys differ':>13}{'counted off':>13}{'counted on':>12}{'rank 0 on':>11}")
    for kind in (None, *skews):
        cases = len(skews.get(kind, []))
        differ = sum(a != b for a, b in zip(ranks[0][f"{kind}/True"]["keys"], ranks[1][f"{kind}/True"]["keys"]))
        counted = [r[f"{kind}/True"]["totals"].get(SITE, [0, 0, 0])[1] for r in ranks]
        off = sum(r[f"{kind}/False"]["totals"].get(SITE, [0, 0, 0])[1] for r in ranks)  # nothing patched: {}
        rows.append({"skew": kind, "cases": cases, "keys_differ": differ, "counted_off": off,
                     "counted_on": counted[1], "rank0_on": counted[0]})
        print(f"{str(kind):<8}{cases:>7}{differ:>13}{off:>13}{counted[1]:>12}{counted[0]:>11}")
    total = sum(r["cases"] for r in rows)
    print(f"{'all':<8}{total:>7}{sum(r['keys_differ'] for r in rows):>13}{sum(r['counted_off'] for r in rows):>13}"
          f"{sum(r['counted_on'] for r in rows):>12}{sum(r['rank0_on'] for r in rows):>11}")
    cost = run_ranks(2, "tests.graph_key_cases:cost_case", release="0.5.23", timeout=600,
                     kwargs={"steps": opts.cost_steps, "reps": opts.reps})
    print("host time per decode step, us (median): the forward (CPU stand-ins for the device work) with the report "
          "off / on, and the bare collective")
    print(f"{'rank':<6}{'forward off':>13}{'forward on':>12}{'+ report':>10}{'bare broadcast':>16}")
    for rank, c in enumerate(cost):
        print(f"{rank:<6}{c['forward off']:>13.1f}{c['forward on']:>12.1f}{c['forward on'] - c['forward off']:>+10.1f}"
              f"{c['bare broadcast']:>16.1f}")
    if opts.json:
        pathlib.Path(opts.json).write_text(json.dumps({"counts": rows, "cost": cost}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
