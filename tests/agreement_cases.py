"""Rank side of tests/test_agreement.py: the agreement table on one installed engine.

For every flag combination it takes the decision the three deciders take (the launcher
and each rank: runtime.apply_once's decide; doctor: cli.report; doctor --engine:
cli.report on the same release read from its sources), in every rotation of
ADAPTERS and of its reverse, applies the launch decision, and returns what each one said.

`layouts` adds the deployment: for each server command in LAYOUTS and every flag
combination, what doctor -- COMMAND, doctor --engine SOURCES -- COMMAND and the wrapper
(the command read with the engine's own parser) decide, and what a rank decides from the
real ServerArgs its Scheduler would receive (built by the engine's prepare_server_args
from the same arguments, resolved where the release resolves them). One layout runs DSpark
with its block size left to the draft checkpoint: the rank knows the verify window the
engine resolved, the command does not.
"""

from __future__ import annotations

import itertools
import os

SELECTOR = [None, "1", "all", "init", "rng", "off", "all,-dspark-mem", "17", "dspark-plan,dflash-target"]
MEMORY = [None, "0", "1"]
# The known-bad guard reads no other adapter: on alone, beside every other flag on, and off.
GUARD = [{"DSV41_KNOWN_BAD_CONFIG": "1"},
         {"DSV41_KNOWN_BAD_CONFIG": "1", "DSV41_SPEC_TP_SYNC": "all", "DSV41_GROUP_MIN_MEM": "1",
          "DSV41_TP_DIVERGENCE": "1"},
         {"DSV41_KNOWN_BAD_CONFIG": "0"}]


def combos() -> list[dict]:
    """Every selector with every memory setting, then every selector with the divergence
    report on (it reads the selector, nothing else), then the known-bad guard (GUARD)."""
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
    return out + [dict(env) for env in GUARD]


def orders(names) -> list[tuple]:
    """Each rotation of `names` and of its reverse: every adapter first and last, every pair
    in both orders (all orders of five adapters would cost minutes per table)."""
    return [tuple(seq[i:] + seq[:i]) for seq in (list(names), list(reversed(names))) for i in range(len(names))]


def _states(decision) -> dict:
    return {o.adapter: o.state for o in decision.outcomes}


def verdicts(environ: dict, engine, installed: bool) -> dict:
    """What every decider says for `environ` on `engine` (one release)."""
    from sglang_dsv41_adapters import cli
    from sglang_dsv41_adapters import ADAPTERS
    from sglang_dsv41_adapters.framework import patching, runtime

    launch = runtime.decide(environ, engine)
    row = {
        "launch_refused": launch.refused,
        "states": _states(launch),
        "reasons": {o.adapter: o.reason for o in launch.outcomes},
        "doctor_failed": cli.report(environ, engine)["failed"],
        "orders": [_states(runtime.decide(environ, engine, names=order)) for order in orders(ADAPTERS)],
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
    from sglang_dsv41_adapters.engine.installed import InstalledEngine, engine_version
    from sglang_dsv41_adapters.engine.source_engine import SourceEngine

    out = {engine_version(): {"installed": [verdicts(env, InstalledEngine(), True) for env in combos()]}}
    for release, tree in source_trees:
        engine = SourceEngine(tree)
        out.setdefault(release, {})["sources"] = [verdicts(env, engine, False) for env in combos()]
    return out


# Server arguments of the layouts the table covers (the model is a local config file,
# see `layouts`): TP only, and DP attention with attention-TP 1 and 2, in the spelling
# every release takes; 0.5.23 also in its own (--attn-dp-size).
LAYOUTS = {
    "tp4": ["--tp-size", "4"],
    "tp4-dp-attention-tp1": ["--tp-size", "4", "--enable-dp-attention", "--dp-size", "4"],
    "tp4-dp-attention-tp2": ["--tp-size", "4", "--enable-dp-attention", "--dp-size", "2"],
}
LAYOUTS_0523 = {"tp4-attn-dp4": ["--tp-size", "4", "--attn-dp-size", "4"]}
DSPARK_LAYOUT = "tp4-dspark"  # its draft checkpoint (`layouts`) says the block size; the engine accepts DSpark on CUDA only
TINY_CONFIG = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64,
               "intermediate_size": 128, "num_attention_heads": 4, "num_key_value_heads": 4,
               "num_hidden_layers": 2, "vocab_size": 1000, "max_position_embeddings": 512}


def rank_server_args(argv: list[str]):
    """The ServerArgs a Scheduler receives for `argv`: built by the engine's own
    prepare_server_args, then resolved as the launcher resolves it (0.5.23)."""
    from sglang.srt.server_args import prepare_server_args

    server_args = prepare_server_args(argv)
    if hasattr(server_args, "resolve_once"):
        server_args.resolve_once()
    return server_args


def layouts(rank, world_size, model_dir, source_tree):
    """{layout: {"command": {...}, "rank": {...}, "rows": [...]}}, one row per combination:
    the outcomes each decider gives and whether doctor --strict / the launch refuse."""
    import json
    import pathlib

    from sglang_dsv41_adapters import cli
    from sglang_dsv41_adapters.framework import runtime, topology
    from sglang_dsv41_adapters.engine.installed import InstalledEngine, engine_version
    from sglang_dsv41_adapters.engine.source_engine import SourceEngine

    from tests.known_bad_config_cases import DRAFT_CONFIG

    pathlib.Path(model_dir, "config.json").write_text(json.dumps(TINY_CONFIG))
    draft = pathlib.Path(model_dir, "draft")
    draft.mkdir(exist_ok=True)
    (draft / "config.json").write_text(json.dumps(DRAFT_CONFIG))
    model = ["--model-path", model_dir, "--device", "cpu", "--skip-tokenizer-init"]
    cases = dict(LAYOUTS, **(LAYOUTS_0523 if engine_version() == "0.5.23" else {}))
    cases[DSPARK_LAYOUT] = ["--tp-size", "4", "--device", "cuda", "--speculative-algorithm", "DSPARK",
                            "--speculative-draft-model-path", str(draft)]
    installed, sources = InstalledEngine(), SourceEngine(source_tree)
    out = {}
    for name, argv in cases.items():
        command = ["python3", "-m", "sglang.launch_server", *model, *argv]
        wrapper_topology, judged = topology.from_command(command)
        rank_topology = topology.from_server_args(rank_server_args([*model, *argv]))
        rows = []
        for env in combos():
            doctor = cli.report(env, installed, wrapper_topology, judged)
            from_sources = cli.report(env, sources, wrapper_topology, judged)
            launch = runtime.decide(env, installed, topology=wrapper_topology)
            in_rank = runtime.decide(env, installed, topology=rank_topology)
            rows.append({
                "doctor": {r["adapter"]: r["state"] for r in doctor["adapters"]},
                "sources": {r["adapter"]: r["state"] for r in from_sources["adapters"]},
                "wrapper": _states(launch), "rank": _states(in_rank),
                "doctor_failed": doctor["failed"], "launch_refused": launch.refused, "rank_refused": in_rank.refused,
                "reasons": {o.adapter: o.reason for o in in_rank.outcomes},
            })
        out[name] = {"command": wrapper_topology and wrapper_topology.__dict__,
                     "rank": rank_topology.__dict__, "rows": rows}
    return out
