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

from adapter import ADAPTERS, load, runtime
from adapter.contract import engine_version
from adapter.source_engine import open_engine

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
        engine = open_engine(opts.engine, workdir) if opts.engine else None
        if engine is None:
            outcomes = runtime.apply_all(os.environ)
        else:
            outcomes = [runtime.decide(load(name), os.environ, patch=False, engine=engine) for name in ADAPTERS]
        rows = []
        for name, outcome in zip(ADAPTERS, outcomes):
            adapter = load(name)
            # The engine check runs whatever the flag says, so that a drifted engine fails
            # `docker build` even though the image is built with every flag unset.
            if outcome.state in (runtime.APPLIED, runtime.SUPERSEDED):
                check = (outcome.state, outcome.reason)
            else:
                check = runtime.engine_check(adapter, patch=False, engine=engine, as_if_on=True)
            rows.append({**outcome.as_dict(), "summary": adapter.SUMMARY, "engine_check": check[0], "engine_check_reason": check[1]})
    if engine is None:
        version, delivery, ranks = engine_version(), runtime.delivery_problems(os.environ), None
    else:
        version, delivery = engine.version, []
        ranks = f"not checked: the engine at {opts.engine} is read from its sources, not installed here"
    unknown = runtime.unknown_flags(os.environ)
    failed = any(r["state"] == runtime.REFUSED or r["engine_check"] == runtime.REFUSED for r in rows)

    if opts.json:
        print(json.dumps({"engine": version, "source": opts.engine, "adapters": rows, "delivery_problems": delivery,
                          "unknown_flags": unknown}, indent=2))
    else:
        print(render_table(version, rows, delivery, ranks, unknown))
    return 1 if opts.strict and (failed or delivery or unknown) else 0


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
    outcomes = runtime.apply_all(os.environ)
    enabled = [o for o in outcomes if o.state != runtime.OFF]
    problems = runtime.unknown_flags(os.environ) + (runtime.delivery_problems(os.environ) if enabled else [])
    error = runtime.refusal(outcomes, problems)
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
