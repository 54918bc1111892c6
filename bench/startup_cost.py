"""Start-up cost of the pack: `entrypoint.py doctor` against importing the same engine modules,
and the per-rank apply time (deciding and applying every adapter once the engine is imported,
as each rank does at the start of Scheduler.__init__).

Each variant runs in a fresh interpreter (as a container start would), several times,
alternating, and the medians are compared within this one run:

    .venv/bin/python bench/startup_cost.py [--repeat 5] [--json OUT] [--before REV]

With --before REV the per-rank apply and doctor with every flag on are also timed on the
pack as it was at git revision REV (its adapter/ and entrypoint.py, exported to a temporary
folder and run against the same engine), alternating with the current tree in the same run.
Each rank judges a TP4 deployment where its runtime takes one (REV's apply_once read from its
source), else every layout.

The current tree keeps its proofs (adapter.engine.proofs) in a temporary folder that
`doctor --strict` with every flag unset fills first, as the image build does; "no proof
cache" is the same tree with SGLANG_ADAPTERS_PROOF_CACHE=off (what a rank pays where nothing
was kept). The load average is printed with the figures: the machine may be shared.
"""

from __future__ import annotations

import argparse
import ast
import importlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

from sglang_dsv41_adapters import ADAPTERS, load

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def engine_modules() -> list[str]:
    # The modules doctor imports: every adapter's targets plus the scheduler the plugin guards.
    names = [name for adapter in ADAPTERS for name, _ in getattr(importlib.import_module(f"sglang_dsv41_adapters.{adapter}"), "TARGETS", ())]
    return sorted(set(names)) + ["sglang.srt.managers.scheduler"]


def timed(argv: list[str], env: dict) -> float:
    start = time.perf_counter()
    subprocess.run(argv, cwd=ROOT, env=env, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return time.perf_counter() - start


def load_average() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def proofs_kept(folder: str, env: dict) -> dict:
    """`env` with the proof cache in `folder`, filled by doctor --strict (flags unset) as the image build does."""
    env = dict(env, SGLANG_ADAPTERS_PROOF_CACHE=folder)
    subprocess.run([sys.executable, "entrypoint.py", "doctor", "--strict"], cwd=ROOT, env=env, check=True,
                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return env


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--json", help="also write the figures to this file")
    parser.add_argument("--before", metavar="REV", help="also time the pack at this git revision, alternating")
    opts = parser.parse_args()
    print(f"load average at the start: {load_average()}")
    if opts.before:
        return before_and_after(opts)
    with tempfile.TemporaryDirectory() as folder:
        return variants(opts, proofs_kept(folder, {k: v for k, v in os.environ.items() if not k.startswith("DSV41_")}))


def variants(opts, env: dict) -> None:
    importer = "import importlib\n" + "".join(f"importlib.import_module({m!r})\n" for m in engine_modules())
    commands = {
        "import engine modules": [sys.executable, "-c", importer],
        "doctor (all flags off)": [sys.executable, "entrypoint.py", "doctor"],
        "doctor --strict, every flag on": [sys.executable, "entrypoint.py", "doctor", "--strict"],
    }
    flags_on = dict(env, **{load(a).flag: load(a).check_value for a in ADAPTERS})
    times = {name: [] for name in commands}
    apply_ms = []
    for _ in range(opts.repeat):
        for name, argv in commands.items():
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
    print(f"load average at the end: {load_average()}")
    if opts.json:
        with open(opts.json, "w") as out:
            json.dump({"modules": engine_modules(), "repeat": opts.repeat, "rows": rows,
                       "per_rank_apply_ms": apply_ms}, out, indent=2)


def per_rank_apply_ms(importer: str, env: dict, tree: str = ROOT, topology: bool = False) -> float:
    """Milliseconds to decide and apply every adapter in a fresh interpreter whose engine
    modules are already imported (what a rank adds to its start-up); with `topology`, for a
    TP4 deployment as a rank judges it from its server_args."""
    deployment = "topology.Topology(4), 'server_args'" if topology else ""
    code = importer + (
        f"import time\nfrom sglang_dsv41_adapters.framework import runtime{', topology' if topology else ''}\nt = time.perf_counter()\n"
        f"runtime.apply_once(__import__('os').environ, {deployment})\n"
        "print('APPLY_MS', (time.perf_counter() - t) * 1000)\n")
    out = subprocess.run([sys.executable, "-c", code], cwd=tree, env=dict(env, PYTHONPATH=tree), check=True,
                         capture_output=True, text=True).stdout
    return float(next(line.split()[1] for line in out.splitlines() if line.startswith("APPLY_MS")))


def takes_topology(tree: str) -> bool:
    """Whether the runtime in `tree` judges a deployment given to apply_once (read, not imported)."""
    path = os.path.join(tree, "adapter", "framework", "runtime.py")
    if not os.path.exists(path):
        return False
    with open(path, encoding="utf-8") as handle:
        found = [n for n in ast.parse(handle.read()).body if isinstance(n, ast.FunctionDef) and n.name == "apply_once"]
    return bool(found) and "topology" in [a.arg for a in found[0].args.args]


def before_and_after(opts) -> None:
    """The per-rank apply and doctor (every flag on) of REV's pack and of this tree (with its
    proofs kept as the image keeps them, and with none), alternating."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("DSV41_")}
    flags_on = dict(env, **{load(a).flag: load(a).check_value for a in ADAPTERS})
    importer = "import importlib\n" + "".join(f"importlib.import_module({m!r})\n" for m in engine_modules())
    with tempfile.TemporaryDirectory() as before, tempfile.TemporaryDirectory() as folder:
        archive = subprocess.run(["git", "archive", opts.before, "adapter", "sglang_dsv41_adapters", "entrypoint.py"], cwd=ROOT, check=True,
                                 capture_output=True).stdout
        subprocess.run(["tar", "-x", "-C", before], input=archive, check=True)
        kept = proofs_kept(folder, env)["SGLANG_ADAPTERS_PROOF_CACHE"]
        trees = {f"before ({opts.before})": (before, takes_topology(before), {}),
                 "after (this tree)": (ROOT, True, {"SGLANG_ADAPTERS_PROOF_CACHE": kept}),
                 "after, no proof cache": (ROOT, True, {"SGLANG_ADAPTERS_PROOF_CACHE": "off"})}
        apply_ms = {name: [] for name in trees}
        doctor_s = {name: [] for name in trees}
        for _ in range(opts.repeat):
            for name, (tree, topology, extra) in trees.items():
                apply_ms[name].append(per_rank_apply_ms(importer, dict(flags_on, **extra), tree, topology))
                doctor_s[name].append(timed([sys.executable, os.path.join(tree, "entrypoint.py"), "doctor"],
                                            dict(flags_on, PYTHONPATH=tree, **extra)))
    print(f"{'every flag on':34} {'per-rank apply ms':>18} {'doctor s':>9}")
    for name in trees:
        print(f"{name:34} {statistics.median(apply_ms[name]):18.0f} {statistics.median(doctor_s[name]):9.2f}"
              f"   runs: {' '.join(f'{v:.0f}' for v in apply_ms[name])} / {' '.join(f'{v:.1f}' for v in doctor_s[name])}")
    print(f"deployment judged: {', '.join(f'{n}: ' + ('TP 4' if t[1] else 'every layout') for n, t in trees.items())}")
    print(f"load average at the end: {load_average()}")
    if opts.json:
        with open(opts.json, "w") as out:
            json.dump({"before": opts.before, "repeat": opts.repeat, "per_rank_apply_ms": apply_ms, "doctor_s": doctor_s},
                      out, indent=2)


if __name__ == "__main__":
    main()
