"""Decisions as records a test can compare between processes: every adapter on at its
broadest setting, for every layout and for TP 4, with each adapter's engine check; of the
installed engine, or of the release read from the sources under a path.

    python -m tests.proof_cases [SOURCE_TREE]   prints RESULT:<json>
"""

from __future__ import annotations

import functools
import json
import os
import sys


def described(value):
    """A plan's wrapper as another process would print it: a function by its name, a partial
    by its function and arguments, plain values as they are, any other object by its type
    and its plain attributes (never its address)."""
    if isinstance(value, (str, int, float, bool, type(None))):
        return value
    if isinstance(value, (tuple, list)):
        return [described(v) for v in value]
    if isinstance(value, functools.partial):
        return ["partial", described(value.func), described(value.args), {k: described(v) for k, v in value.keywords.items()}]
    if callable(value) and hasattr(value, "__qualname__"):
        return f"{getattr(value, '__module__', '?')}.{value.__qualname__}"
    plain = {k: described(v) for k, v in sorted(vars(value).items()) if isinstance(v, (str, int, float, bool, tuple))} \
        if hasattr(value, "__dict__") else {}
    return [type(value).__qualname__, plain]


def record(decision) -> dict:
    """Everything a decision says and plans."""
    def patch(p):
        return [p.where, described(p.wrapper), getattr(p.proxy, "__qualname__", None)]

    return {"engine": decision.engine, "outcomes": [o.as_dict() for o in decision.outcomes],
            "problems": list(decision.problems), "flag_errors": list(decision.flag_errors),
            "plans": {name: [plan.state, plan.detail, [patch(p) for p in plan.patches], plan.env]
                      for name, plan in decision.plans.items()}}


def decisions(engine=None) -> dict:
    from sglang_dsv41_adapters import ADAPTERS, load
    from sglang_dsv41_adapters.framework import runtime, topology

    environ = {load(name).flag: load(name).check_value for name in ADAPTERS}
    found = {}
    for layout in (None, topology.Topology(4)):
        found[f"decide {layout}"] = record(runtime.decide(environ, engine, topology=layout))
        found[f"engine check {layout}"] = [list(runtime.engine_check(load(name), engine, layout)) for name in ADAPTERS]
    return found


def main() -> None:
    from sglang_dsv41_adapters.engine.source_engine import SourceEngine

    engine = SourceEngine(sys.argv[1]) if len(sys.argv) > 1 else None
    found = decisions(engine)
    names = sorted(os.listdir(os.environ["DSV41_ADAPTERS_PROOF_CACHE"])) \
        if os.path.isdir(os.environ.get("DSV41_ADAPTERS_PROOF_CACHE", "")) else []
    print("RESULT:" + json.dumps({"decisions": found, "entries": names}), flush=True)


if __name__ == "__main__":
    main()
