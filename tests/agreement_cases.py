"""Rank side of tests/test_agreement.py: the agreement table on one installed engine.

For every flag combination it takes the decision the three deciders take (the launcher
and each rank: runtime.apply_once's decide; doctor: entrypoint.report; doctor --engine:
entrypoint.report on the same release read from its sources), in every order of
ADAPTERS, applies the launch decision, and returns what each one said.
"""

from __future__ import annotations

import itertools
import os

SELECTOR = [None, "1", "all", "init", "rng", "off", "all,-dspark-mem", "17", "dspark-plan,dflash-target"]
MEMORY = [None, "0", "1"]


def combos() -> list[dict]:
    """Every selector with every memory setting, then every selector with the divergence
    report on (it reads the selector, nothing else)."""
    out = []
    for selector, memory, report in [*itertools.product(SELECTOR, MEMORY, [None]),
                                     *itertools.product(SELECTOR, [None], ["1"])]:
        env = {}
        if selector is not None:
            env["DSV41_SPEC_TP_SYNC"] = selector
        if memory is not None:
            env["DSV41_GROUP_MIN_MEM"] = memory
        if report is not None:
            env["DSV41_TP_DIVERGENCE"] = report
        out.append(env)
    return out


def _states(decision) -> dict:
    return {o.adapter: o.state for o in decision.outcomes}


def verdicts(environ: dict, engine, installed: bool) -> dict:
    """What every decider says for `environ` on `engine` (one release)."""
    import entrypoint
    from adapter import ADAPTERS, patching, runtime

    launch = runtime.decide(environ, engine)
    row = {
        "launch_refused": launch.refused,
        "states": _states(launch),
        "reasons": {o.adapter: o.reason for o in launch.outcomes},
        "doctor_failed": entrypoint.report(environ, engine)["failed"],
        "orders": [_states(runtime.decide(environ, engine, names=order))
                   for order in itertools.permutations(ADAPTERS)],
    }
    if installed and not launch.refused:
        # The launch path carries the decision out: only adapters that are on may touch
        # the engine, and only rank0_broadcast (switched on) may hand anything over.
        before = os.environ.get("SGLANG_SPEC_TP_SYNC")
        runtime.apply(launch)
        row["patched_by"] = sorted({s.adapter for s in patching.applied()})
        row["handed"] = {var: adapter for var, adapter in patching.applied_env().items()}
        runtime.revert()
        assert os.environ.get("SGLANG_SPEC_TP_SYNC") == before
    return row


def table(rank, world_size, source_trees):
    """{release: {"installed": [...], "sources": [...]}} for the installed release and
    each (release, tree) in source_trees, one row per combination."""
    from adapter.contract import InstalledEngine, engine_version
    from adapter.source_engine import SourceEngine

    out = {engine_version(): {"installed": [verdicts(env, InstalledEngine(), True) for env in combos()]}}
    for release, tree in source_trees:
        engine = SourceEngine(tree)
        out.setdefault(release, {})["sources"] = [verdicts(env, engine, False) for env in combos()]
    return out
