"""Drift table and cost of the pack's own site 31:pack-dflash-draft-greedy (DFlash's greedy
draft proposal, rank-local in every release),
in one run, the way upstream peers report TP drift (vLLM's drift test: 20 mismatches -> 0 over
120 cases).

    python bench/dflash_draft_drift.py [--cases 120] [--reps 30] [--json OUT] [--cpu]

Two ranks (harness/nccl.py spawn_ranks): gloo CPU processes by default, NCCL on two GPUs when
there are two (--cpu forces gloo), over sglang 0.5.23's own GroupCoordinator. Each path is the
engine's own DFlash draft code (tests/dflash_draft_cases.py): Domino rollout, selector lattice,
plain head without shard_indices (rank-local), plain head on a vocab-parallel head
(shard_indices: all-gathered, TP-safe, not broadcast). Every one of --cases steps injects a skew
on rank 1 that moves its own argmax on the rank-local paths.

Drift: per path, with the site off and on, the cases where rank 1's block differed from rank
0's, and the cases where the skew moved rank 1's own proposal at all.
Cost per decode step (median of --reps): the path with the site off and on, the difference,
and a bare group.broadcast of the same block, in the same run: on GPUs once eager and once
captured (the samplers replayed from a CUDA graph, the broadcast inside it, as the engine's
draft graph runs them; the plain head is eager in the engine, so only eager there); on gloo
eager only (a check that it runs; the figures are gloo's).
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from harness.nccl import spawn_ranks  # noqa: E402

PATHS = ("domino", "selector", "plain_local", "plain_sharded")


def _run(nccl: bool, cases: int, reps: int, capture: bool, timeout: float) -> list:
    return spawn_ranks(2, "tests.dflash_draft_cases:draft_case", nccl=nccl, timeout=timeout,
                       kwargs={"n": cases, "skewed": list(range(cases)), "paths": list(PATHS),
                               "variants": ["off", "on"], "timing": reps, "capture_samplers": capture})


def drift_table(ranks, cases: int) -> list[str]:
    one = ranks[1]["paths"]
    lines = [f"{'path':<15}{'cases':>7}{'skew moved rank 1':>19}{'mismatches off':>16}{'mismatches on':>15}"]
    for name in PATHS:
        lines.append(f"{name:<15}{cases:>7}{len(one[name]['off']['skew_moved']):>19}"
                     f"{len(one[name]['off']['steps_off']):>16}{len(one[name]['on']['steps_off']):>15}")
    return lines


def cost_table(ranks, label: str) -> list[str]:
    lines = [f"{label}: microseconds per decode step, rank 0 / rank 1",
             f"{'path':<15}{'captured':>9}{'site off':>20}{'site on':>20}{'site cost':>20}{'bare broadcast':>20}"]
    for name in PATHS:
        cells = []
        for rank in ranks:
            path = rank["paths"][name]
            off, on = path["off"]["seconds"]["path"] * 1e6, path["on"]["seconds"]["path"] * 1e6
            cells.append((off, on, on - off, path["on"]["seconds"]["bare_broadcast"] * 1e6))
        pair = lambda i: f"{cells[0][i]:.1f} / {cells[1][i]:.1f}"  # noqa: E731
        captured = ranks[0]["paths"][name]["on"]["captured"]
        lines.append(f"{name:<15}{'yes' if captured else 'no':>9}{pair(0):>20}{pair(1):>20}{pair(2):>20}{pair(3):>20}")
    return lines


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", type=int, default=120)
    parser.add_argument("--reps", type=int, default=30)
    parser.add_argument("--cpu", action="store_true", help="gloo CPU processes even with GPUs")
    parser.add_argument("--timeout", type=float, default=280)
    parser.add_argument("--json")
    args = parser.parse_args()
    nccl = not args.cpu and torch.cuda.is_available() and torch.cuda.device_count() >= 2
    runs = {"eager": _run(nccl, args.cases, args.reps, False, args.timeout)}
    if nccl:
        runs["captured"] = _run(nccl, args.cases, args.reps, True, args.timeout)
    first = runs["eager"]
    print(f"TP 2 over {first[0]['group']}, sglang {first[0]['sglang']}, {args.cases} injected-skew cases per path")
    for label, ranks in runs.items():
        print(f"\nDrift ({label}): site 31:pack-dflash-draft-greedy off / on")
        print("\n".join(drift_table(ranks, args.cases)))
    for label, ranks in runs.items():
        print()
        print("\n".join(cost_table(ranks, label)))
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps({"nccl": nccl, "cases": args.cases, "runs": runs}, indent=1))
    failed = [f"{label}/{name}" for label, ranks in runs.items() for name in PATHS
              if ranks[1]["paths"][name]["on"]["steps_off"] or ranks[0]["paths"][name]["on"]["steps_off"]]
    if failed:
        print(f"\nFAILED: mismatches with the site on in {', '.join(failed)}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
