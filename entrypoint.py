"""Container entrypoint of the SGLang adapter pack.

    entrypoint.py doctor [--json] [--strict] [--engine PATH]
                                               report every adapter against the installed engine,
                                               or against a wheel / source tree read without importing it
    entrypoint.py [launch] SERVER-ARGS...      check flags and engine, apply the adapters here,
                                               then run `python -m sglang.launch_server SERVER-ARGS...`

The launch path stops with exit status 2, before any rank starts, when an adapter is
refused (bad flag value, drifted engine) or when the ranks could not load the pack.
"""

from __future__ import annotations

import argparse
import json
import os
import runpy
import sys
import tempfile

from adapter import delivery, load, runtime
from adapter.contract import InstalledEngine
from adapter.source_engine import EngineSourceError, open_engine

SERVER_MODULE = "sglang.launch_server"


def doctor(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="entrypoint.py doctor", description="Report every adapter's outcome.")
    parser.add_argument("--json", action="store_true", help="print JSON for machines instead of a table")
    parser.add_argument("--strict", action="store_true", help="exit 1 if any adapter is refused, on or off")
    parser.add_argument(
        "--engine", metavar="PATH",
        help="check an engine that is not imported here: an sglang wheel, or a folder holding sglang/ "
        "(an unpacked wheel or site-packages); read from its sources, nothing of it runs",
    )
    opts = parser.parse_args(argv)

    with tempfile.TemporaryDirectory() as workdir:
        try:
            engine = open_engine(opts.engine, workdir) if opts.engine else InstalledEngine()
        except EngineSourceError as exc:
            print(f"{runtime.PREFIX} doctor --engine: {exc}", file=sys.stderr, flush=True)
            return 2
        found = report(os.environ, engine)
        unjudged = opts.engine and not found["delivery_problems"] and delivery.discovery_module(engine) is None
    ranks = None
    if unjudged:
        ranks = (f"run_scheduler_process calls the plugin loader; which plugins it finds is not checked: the engine at "
                 f"{opts.engine} is read from its sources and its loader is not the one installed here")
    if opts.json:
        print(json.dumps({key: found[key] for key in ("engine", "adapters", "delivery_problems", "unknown_flags", "problems")}
                         | {"source": opts.engine}, indent=2))
    else:
        if found["delivery_problems"] and not found["enabled"]:
            ranks = "; ".join(found["delivery_problems"]) + " (every adapter is off: nothing is lost, the launch goes on)"
        print(render_table(found["engine"], found["adapters"], found["delivery_problems"], ranks, found["unknown_flags"]))
    return 1 if opts.strict and found["failed"] else 0


def report(environ, engine) -> dict:
    """doctor's findings: the decision the launcher and every rank take for `environ` on
    `engine`, plus each adapter's engine check (switched on, every other adapter off), so
    that a drifted engine fails `docker build` although the image is built with every flag
    unset. `failed` is what --strict exits 1 on."""
    decision = runtime.decide(environ, engine)
    rows = []
    for outcome in decision.outcomes:
        adapter = load(outcome.adapter)
        check = runtime.engine_check(adapter, engine)
        rows.append({**outcome.as_dict(), "summary": adapter.SUMMARY, "engine_check": check[0], "engine_check_reason": check[1]})
    return {
        "engine": decision.engine, "adapters": rows, "enabled": decision.enabled, "problems": decision.problems,
        "delivery_problems": runtime.delivery_problems(environ, engine),
        "unknown_flags": runtime.unknown_flags(environ),
        "failed": decision.refused or any(r["engine_check"] == runtime.REFUSED for r in rows),
    }


def render_table(version: str, rows: list[dict], delivery: list[str], ranks: str | None = None,
                 unknown: list[str] = ()) -> str:
    header = ("adapter", "flag", "value", "outcome", "engine check")
    table = [header] + [
        (r["adapter"], r["flag"], "<unset>" if r["value"] is None else r["value"], r["state"], r["engine_check"])
        for r in rows
    ]
    widths = [max(len(row[i]) for row in table) for i in range(len(header))]
    lines = [f"sglang {version}", ""]
    lines += ["  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in table]
    lines.append("")
    for r in rows:
        lines.append(f"{r['adapter']}: {r['summary']}")
        lines.append(f"  outcome: {r['reason']}")
        if r["engine_check_reason"] != r["reason"]:
            lines.append(f"  engine check: {r['engine_check_reason']}")
    lines.append("")
    if ranks is None:
        ranks = "; ".join(delivery) if delivery else "every TP rank loads the pack through the engine's plugin loader"
    lines.append("ranks: " + ranks)
    for problem in unknown:
        lines.append("flags: " + problem)
    return "\n".join(lines)


def launch(argv: list[str]) -> int:
    error = runtime.apply_once(os.environ).error()
    if error is not None:
        print(f"{runtime.PREFIX} {error}", file=sys.stderr, flush=True)
        return 2
    sys.argv = [SERVER_MODULE, *argv]
    runpy.run_module(SERVER_MODULE, run_name="__main__", alter_sys=True)
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["doctor"]:
        return doctor(argv[1:])
    if argv[:1] == ["launch"]:
        argv = argv[1:]
    return launch(argv)


if __name__ == "__main__":
    sys.exit(main())
