"""Start-up cost of the pack: `entrypoint.py doctor` against importing the same engine modules,
and the per-rank apply time (deciding and applying every adapter once the engine is imported,
as each rank does at the start of Scheduler.__init__).

Each variant runs in a fresh interpreter (as a container start would), several times,
alternating, and the medians are compared within this one run:

    .venv/bin/python bench/startup_cost.py [--repeat 5] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

from adapter import ADAPTERS, load

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def engine_modules() -> list[str]:
    # The modules doctor imports: every adapter's targets plus the scheduler the plugin guards.
    names = [name for adapter in ADAPTERS for name, _ in load(adapter).TARGETS]
    return sorted(set(names)) + ["sglang.srt.managers.scheduler"]


def timed(argv: list[str], env: dict) -> float:
    start = time.perf_counter()
    subprocess.run(argv, cwd=ROOT, env=env, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--json", help="also write the figures to this file")
    opts = parser.parse_args()
    env = {k: v for k, v in os.environ.items() if not k.startswith("DSV41_")}
    importer = "import importlib\n" + "".join(f"importlib.import_module({m!r})\n" for m in engine_modules())
    variants = {
        "import engine modules": [sys.executable, "-c", importer],
        "doctor (all flags off)": [sys.executable, "entrypoint.py", "doctor"],
        "doctor --strict, every flag on": [sys.executable, "entrypoint.py", "doctor", "--strict"],
    }
    flags_on = dict(env, **{load(a).FLAG: load(a).CHECK_VALUE for a in ADAPTERS})
    times = {name: [] for name in variants}
    apply_ms = []
    for _ in range(opts.repeat):
        for name, argv in variants.items():
            times[name].append(timed(argv, flags_on if "every flag on" in name else env))
        apply_ms.append(per_rank_apply_ms(importer, flags_on))
    base = statistics.median(times["import engine modules"])
    print(f"{'variant':34} {'median s':>9} {'added s':>8}   runs")
    rows = []
    for name, values in times.items():
        median = statistics.median(values)
        rows.append({"variant": name, "median_s": round(median, 3), "added_s": round(median - base, 3), "runs_s": [round(v, 3) for v in values]})
        print(f"{name:34} {median:9.2f} {median - base:8.2f}   {' '.join(f'{v:.2f}' for v in values)}")
    print(f"{'per-rank apply, every flag on (ms)':34} {statistics.median(apply_ms):9.0f}"
          f"            {' '.join(f'{v:.0f}' for v in apply_ms)}")
    if opts.json:
        with open(opts.json, "w") as out:
            json.dump({"modules": engine_modules(), "repeat": opts.repeat, "rows": rows,
                       "per_rank_apply_ms": apply_ms}, out, indent=2)


def per_rank_apply_ms(importer: str, env: dict) -> float:
    """Milliseconds to decide and apply every adapter in a fresh interpreter whose engine
    modules are already imported (what a rank adds to its start-up)."""
    code = importer + (
        "import time\nfrom adapter import runtime\nt = time.perf_counter()\nruntime.apply_once()\n"
        "print('APPLY_MS', (time.perf_counter() - t) * 1000)\n")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, check=True, capture_output=True, text=True).stdout
    return float(next(line.split()[1] for line in out.splitlines() if line.startswith("APPLY_MS")))


if __name__ == "__main__":
    main()
