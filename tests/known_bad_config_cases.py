"""Rank side of tests/test_known_bad_config.py: the deciders on the engine this interpreter
imports (the installed 0.5.23, or a copy of it with the write pad taken out, first on the
path), for DSpark commands with and without the block size.

For each command: what doctor -- COMMAND, doctor --engine SOURCES -- COMMAND, the wrapper
(the command read with the engine's own parser) and a rank decide, the rank from the real
ServerArgs its Scheduler receives: the engine's prepare_server_args, which reads the block
size from the draft checkpoint where the command leaves it out, resolved as the launcher
resolves it. `through_plugin` then builds the Scheduler through the engine's plugin loader,
as a spawned rank does, with the ServerArgs of the last command.
"""

from __future__ import annotations

import json
import pathlib

FLAG = {"DSV41_KNOWN_BAD_CONFIG": "1"}
DRAFT_CONFIG = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64,
                "intermediate_size": 128, "num_attention_heads": 4, "num_key_value_heads": 4, "num_hidden_layers": 1,
                "vocab_size": 1000, "max_position_embeddings": 512,
                "dspark_block_size": 5}  # as DeepSeek-V4-Flash-0731's draft checkpoint says


def server_argv(model_dir: str, draft_dir: str, extra: list[str], draft_config: dict = DRAFT_CONFIG) -> list[str]:
    """A DSpark server's arguments (the engine accepts DSpark only on an accelerator device;
    nothing here touches one: the arguments are parsed and resolved, never run)."""
    from tests.agreement_cases import TINY_CONFIG

    pathlib.Path(model_dir, "config.json").write_text(json.dumps(TINY_CONFIG))
    pathlib.Path(draft_dir, "config.json").write_text(json.dumps(draft_config))
    return ["--model-path", model_dir, "--skip-tokenizer-init", "--device", "cuda", "--tp-size", "4",
            "--speculative-algorithm", "DSPARK", "--speculative-draft-model-path", draft_dir, *extra]


def deciders(rank, world_size, model_dir, draft_dir, source_tree, cases, through_plugin=False, draft_config=None):
    """{case: {"doctor", "sources", "wrapper", "rank": (state, reason), "doctor_failed",
    "launch_refused", "rank_refused", "command", "resolved"}} for each case (name -> extra
    server arguments), and with `through_plugin` the refusal a Scheduler built through the
    engine's plugin loader raises for the last case. `draft_config`: the draft checkpoint's
    config (default DRAFT_CONFIG, block size 5)."""
    from sglang_dsv41_adapters import cli
    from sglang_dsv41_adapters.engine.installed import InstalledEngine
    from sglang_dsv41_adapters.engine.source_engine import SourceEngine
    from sglang_dsv41_adapters.framework import runtime, topology
    from tests.agreement_cases import rank_server_args

    installed, sources = InstalledEngine(), SourceEngine(source_tree)

    def mine(outcomes):
        found = next(o for o in outcomes if o.adapter == "known_bad_config")
        return found.state, found.reason

    out, server_args = {}, None
    for name, extra in cases.items():
        argv = server_argv(model_dir, draft_dir, extra, draft_config or DRAFT_CONFIG)
        command, judged = topology.from_command(["python3", "-m", "sglang.launch_server", *argv])
        server_args = rank_server_args(argv)
        resolved = topology.from_server_args(server_args)
        doctor = cli.report(FLAG, installed, command, judged)
        from_sources = cli.report(FLAG, sources, command, judged)
        launch = runtime.decide(FLAG, installed, topology=command)
        in_rank = runtime.decide(FLAG, installed, topology=resolved)
        out[name] = {
            "doctor": next((r["state"], r["reason"]) for r in doctor["adapters"] if r["adapter"] == "known_bad_config"),
            "sources": next((r["state"], r["reason"]) for r in from_sources["adapters"]
                            if r["adapter"] == "known_bad_config"),
            "wrapper": mine(launch.outcomes), "rank": mine(in_rank.outcomes),
            "doctor_failed": doctor["failed"], "launch_refused": launch.refused, "rank_refused": in_rank.refused,
            "command": command.server_args, "resolved": resolved.server_args,
        }
    if through_plugin:
        out["plugin"] = build_scheduler(server_args)
    return out


def build_scheduler(server_args) -> dict:
    """The engine's plugin loader, then its Scheduler on these ServerArgs, as
    run_scheduler_process does: the pack decides at the start of Scheduler.__init__."""
    from sglang.srt.plugins import load_plugins

    from sglang_dsv41_adapters.framework import runtime

    load_plugins()
    from sglang.srt.managers.scheduler import Scheduler

    try:
        Scheduler(server_args, None)
    except runtime.AdapterRefused as exc:
        return {"refused": str(exc)}
    except Exception as exc:  # the real constructor on a placeholder port_args: the pack let it start
        return {"constructor": f"{type(exc).__name__}: {exc}"}
    return {"started": True}
