"""The pack reaches every engine process through the engine's own plugin loader.

Each case runs in a real `multiprocessing` spawn child (the start method the engine
uses for its TP ranks), which calls sglang's `load_plugins()` and then constructs the
engine's `Scheduler`, as `run_scheduler_process` does. The first case's child is a fresh
interpreter; the others start from a warm parent that has imported the engine, not the pack
(harness.zygote.warm_spawn), as a rank has imported the scheduler module before its loader runs. The adapters are applied at
the start of `Scheduler.__init__`; the rest of that constructor is not run here (it
fails on the placeholder arguments, after the adapters have been applied).
"""

from __future__ import annotations

import ast
import contextlib
import importlib.util
import json
import multiprocessing

import pytest

from sglang_dsv41_adapters import folded_fence
from sglang_dsv41_adapters.framework import runtime
from harness import zygote
from harness.engines import ROOT, engine_env, python
from tests.log_lines import untimed


# A second engine module that binds the fenced method before the pack applies.
ALIASING = "sglang.srt.speculative.spec_utils"
ALIAS = ("\nfrom sglang.srt.speculative.dspark_components.dspark_verify import TargetVerifyExecutor as _Executor\n"
         "finalize_verify = _Executor.accept_and_finalize\n")


def rank_process(doctor_engine, tmp_dir: str, results, server_argv=None) -> None:
    import sglang.srt.managers.scheduler  # noqa: F401 - as in a rank: the loader runs inside run_scheduler_process
    from sglang.srt.plugins import load_plugins

    load_plugins()
    # The ServerArgs a rank's Scheduler receives: the engine's own parser, resolved as the launcher does.
    server_args = None
    if server_argv is not None:
        from tests.agreement_cases import rank_server_args

        server_args = rank_server_args(server_argv)
    import sys

    from harness.doctored import doctored_module

    if doctor_engine == "alias":  # an engine that binds the original in a second module
        sys.modules[ALIASING] = doctored_module(ALIASING, tail=ALIAS, directory=tmp_dir)
    elif doctor_engine:  # a drifted engine: dspark_verify with its AcceptOuts changed
        sys.modules[folded_fence.VERIFY] = doctored_module(
            folded_fence.VERIFY, ("    out_tokens: torch.Tensor\n", "    out_tokens: torch.Tensor\n    extra: torch.Tensor\n"),
            directory=tmp_dir,
        )
    from sglang.srt.managers.scheduler import Scheduler

    try:
        Scheduler(server_args, None)
    except runtime.AdapterRefused:
        raise  # the refusal must stop this process
    except Exception as exc:  # the real constructor on placeholder arguments
        results.put(("constructor", type(exc).__name__))
    from sglang_dsv41_adapters.framework import patching

    from sglang_dsv41_adapters.framework import plugin

    # What the runtime replaced in this rank, by adapter and binding; whether the guard ran the adapters
    results.put(("patched", sorted(f"{s.adapter}:{s.name}" for s in patching.applied() if s.adapter != plugin.GUARD)))
    results.put(("guarded", plugin.guarded()))


def spawn_rank(monkeypatch, flag, tmp_path, doctor_engine=False, server_argv=None, fresh=False):
    if flag is None:
        monkeypatch.delenv(folded_fence.FLAG, raising=False)
    else:
        monkeypatch.setenv(folded_fence.FLAG, flag)
    context = multiprocessing.get_context("spawn")
    results = context.Queue()
    child = context.Process(target=rank_process, args=(doctor_engine, str(tmp_path), results, server_argv))
    with contextlib.nullcontext() if fresh else zygote.warm_spawn(context):
        child.start()
    child.join(timeout=180)
    assert not child.is_alive(), "the spawned rank hung"
    found = {}
    while not results.empty():
        key, value = results.get()
        found[key] = value
    return child.exitcode, found


def test_spawned_rank_applies_the_fence_when_the_flag_is_set(monkeypatch, tmp_path, capfd):
    code, found = spawn_rank(monkeypatch, "1", tmp_path, fresh=True)
    assert code == 0
    assert "constructor" in found
    assert found["patched"] == ["folded_fence:_block_accept_lens", "folded_fence:accept_and_finalize",
                                "folded_fence:forward_batch_generation", "folded_fence:run"]
    assert found["guarded"]
    err = capfd.readouterr().err
    assert "folded_fence DSV41_FOLDED_FENCE='1': APPLIED - copy: clones (no CUDA); fenced TargetVerifyExecutor." in err


def test_spawned_rank_is_untouched_when_the_flag_is_unset(monkeypatch, tmp_path, capfd):
    code, found = spawn_rank(monkeypatch, None, tmp_path)
    assert code == 0
    assert "constructor" in found and found["patched"] == [] and found["guarded"]
    assert "folded_fence DSV41_FOLDED_FENCE=<unset>: OFF" in capfd.readouterr().err


@pytest.mark.parametrize("flag,doctor_engine,reason", [
    ("1", True, "AcceptOuts: fields are ('correct_len', 'bonus', 'cap_trim_lens', 'commit_lens', 'new_seq_lens', 'out_tokens', 'extra')"),
    ("yes please", False, "DSV41_FOLDED_FENCE='yes please' is not understood"),
    ("1", "alias", f"folded_fence refused on sglang 0.5.23: {ALIASING}.finalize_verify holds the original "
                   "sglang.srt.speculative.dspark_components.dspark_verify.TargetVerifyExecutor.accept_and_finalize "
                   "that folded_fence wrapped"),
])
def test_refusal_inside_a_spawned_rank_stops_it(monkeypatch, tmp_path, capfd, flag, doctor_engine, reason):
    code, found = spawn_rank(monkeypatch, flag, tmp_path, doctor_engine=doctor_engine)
    assert code != 0
    assert "patched" not in found and "constructor" not in found  # the engine's constructor never ran
    err = capfd.readouterr().err
    assert "AdapterRefused: the engine must not start: " in err
    assert reason in err
    assert "sglang 0.5.23" in err


def test_the_engine_turns_an_exception_in_scheduler_construction_into_a_tree_kill():
    """The refusal relies on run_scheduler_process catching Exception around
    Scheduler(...) and signalling the launcher (SIGQUIT), which kills the process tree."""
    origin = importlib.util.find_spec("sglang.srt.managers.scheduler").origin
    tree = ast.parse(open(origin, encoding="utf-8").read())
    func = next(n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "run_scheduler_process")
    first = func.body[0] if not isinstance(func.body[0], ast.Expr) or not isinstance(func.body[0].value, ast.Constant) else func.body[1]
    assert ast.unparse(first) == "load_plugins()"
    guarded = [n for n in ast.walk(func) if isinstance(n, ast.Try) and "Scheduler(server_args, port_args)" in ast.unparse(n.body)]
    assert len(guarded) == 1
    handler = guarded[0].handlers[0]
    assert ast.unparse(handler.type) == "Exception"
    assert "parent_process.send_signal(signal.SIGQUIT)" in ast.unparse(handler)
    assert issubclass(runtime.AdapterRefused, Exception)


def test_master_switch_off_leaves_a_spawned_rank_untouched_with_every_flag_set(monkeypatch, tmp_path, capfd):
    """DSV41_ADAPTERS=off: the rank, loading the pack through the engine's plugin loader with
    every adapter's flag still set (the fence to a value that would refuse), applies nothing
    and says so in one line."""
    monkeypatch.setenv("DSV41_ADAPTERS", "OFF")  # the off words of every flag, in any case
    monkeypatch.setenv("DSV41_SPEC_TP_SYNC", "all")
    monkeypatch.setenv("DSV41_GROUP_MIN_MEM", "1")
    code, found = spawn_rank(monkeypatch, "1", tmp_path)
    assert code == 0
    assert "constructor" in found and found["patched"] == [] and found["guarded"]
    lines = [line for line in untimed(capfd.readouterr().err) if line.startswith(runtime.PREFIX)]
    assert len(lines) == 1, lines
    assert "DSV41_ADAPTERS='off': OFF - the whole pack is off" in lines[0] and "sglang 0.5.23" in lines[0]
    assert " rank=launcher " not in lines[0], "a rank's line names it as a scheduler"


def test_any_other_master_switch_value_stops_a_spawned_rank(monkeypatch, tmp_path, capfd):
    monkeypatch.setenv("DSV41_ADAPTERS", "on")
    monkeypatch.setenv("DSV41_ADAPTERS_LOG", "json")
    code, found = spawn_rank(monkeypatch, None, tmp_path)
    assert code != 0 and "constructor" not in found
    err = capfd.readouterr().err
    assert "AdapterRefused: the engine must not start: DSV41_ADAPTERS='on' is not understood" in err
    # the fatal line too is one JSON object in JSON mode, before the engine's own traceback
    (fatal,) = [json.loads(line) for line in err.splitlines() if line.startswith("{") and '"fatal":true' in line]
    assert fatal["message"].startswith("the engine must not start: DSV41_ADAPTERS='on'") and fatal["time"]


@pytest.mark.parametrize("layout,memory", [(["--tp-size", "4"], "superseded"),
                                           (["--tp-size", "4", "--enable-dp-attention", "--dp-size", "4"], "applied")])
def test_a_spawned_rank_judges_the_server_args_its_scheduler_receives(monkeypatch, tmp_path, capfd, layout, memory):
    """DSV41_GROUP_MIN_MEM=1 on 0.5.23: TP 4 is the engine's own group minimum (superseded,
    nothing patched); DP attention with attention-TP 1 leaves the engine's probe per rank, so
    the rank wraps SpecTpSync.available_memory_gb. The rank reads its deployment from the real
    ServerArgs (the engine's prepare_server_args, resolved) it is constructed with."""
    from tests.agreement_cases import TINY_CONFIG

    (tmp_path / "config.json").write_text(json.dumps(TINY_CONFIG))
    monkeypatch.setenv("DSV41_GROUP_MIN_MEM", "1")
    argv = ["--model-path", str(tmp_path), "--device", "cpu", "--skip-tokenizer-init", *layout]
    code, found = spawn_rank(monkeypatch, None, tmp_path, server_argv=argv)
    assert code == 0 and "constructor" in found
    wrapped = "group_min_memory:available_memory_gb" in found["patched"]
    assert wrapped == (memory == "applied"), found["patched"]
    err = capfd.readouterr().err
    described = "TP 4, no DP attention" if memory == "superseded" else "TP 4, DP attention 4 x attention-TP 1"
    assert f"deployment: {described} (this rank's server_args)" in err
    assert f"group_min_memory DSV41_GROUP_MIN_MEM='1': {memory.upper()} - " in err


HOOKED = """
import logging, sys
logging.basicConfig(level=logging.INFO, format="%(name)s %(message)s", force=True)
import sglang.srt.managers.scheduler as scheduler  # a rank: run_scheduler_process lives there
from sglang.srt.plugins import load_plugins
load_plugins()
from sglang_dsv41_adapters.framework import patching, plugin
print("guard", plugin.guarded(), [s.adapter for s in patching.applied()])
try:
    scheduler.Scheduler(None, None)
except Exception as exc:
    print("raised", type(exc).__name__, str(exc)[:120])
"""


def test_the_guard_is_the_engines_hook_and_a_refusal_still_stops_the_scheduler():
    """The engine's HookRegistry applies the pack's guard and lists it in the engine's own log;
    a refusal raised inside it still ends Scheduler(...)."""
    done = zygote.run([python(), "-c", HOOKED], cwd=ROOT, env=engine_env("0.5.23", DSV41_FOLDED_FENCE="yes please"),
                      capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    assert ("sglang.srt.plugins.hook_registry Applied 1 hook(s) to sglang.srt.managers.scheduler.Scheduler.__init__ "
            "(from: plugin=dsv41_adapters, dist=sglang-dsv41-adapters)") in done.stderr, done.stderr[-3000:]
    assert "guard True []" in done.stdout  # the engine's hook, not a binding of the pack's
    assert "raised AdapterRefused the engine must not start: DSV41_FOLDED_FENCE='yes please' is not understood" \
        in done.stdout, done.stdout
