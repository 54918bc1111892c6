"""The pack's command line against the real engine: help texts, the wrapper running real
commands, the exit-status table, doctor --json against its schema file, the per-process
lines (length, JSON form), near-miss flag names."""

from __future__ import annotations

import json
import os
import pathlib
import re
import subprocess
import tomllib

import pytest

from sglang_dsv41_adapters import cli
from sglang_dsv41_adapters.engine import settings
from sglang_dsv41_adapters import ADAPTERS, load
from sglang_dsv41_adapters.framework import runtime
from sglang_dsv41_adapters.engine.source_engine import SourceEngine
from tests.agreement_cases import combos
from harness.engines import ROOT, engine_env, python, release_sources
from harness import zygote
from tests.log_lines import untimed

SCHEMA = json.loads((ROOT / "docs" / "doctor-report.schema.json").read_text())


def run_cli(*args: str, release: str = "0.5.23", timeout: float = 240, **env: str) -> subprocess.CompletedProcess:
    """entrypoint.py with the venv's bin first on PATH, as in the image (python3, sglang)."""
    path = f"{pathlib.Path(python()).parent}{os.pathsep}{os.environ['PATH']}"
    return zygote.run([python(), "entrypoint.py", *args], cwd=ROOT, env=engine_env(release, PATH=path, **env),
                          capture_output=True, text=True, timeout=timeout)


def pack_lines(stderr: str) -> list[str]:
    return [line for line in untimed(stderr) if line.startswith(runtime.PREFIX)]


# --- help and version ------------------------------------------------------------------------

def test_help_explains_the_pack_its_flags_and_exit_statuses(capsys):
    with pytest.raises(SystemExit) as done:
        cli.main(["--help"])
    assert done.value.code == 0
    text = capsys.readouterr().out
    assert text.startswith("usage: sglang-adapters ") and "The SGLang adapter pack" in text
    for flag in runtime.pack_flags():
        assert flag in text
    for code, _ in cli.EXIT_STATUSES:
        assert re.search(rf"^  {code} ", text, re.M), code
    assert "sglang-adapters [--] COMMAND" in text and "--model-path" in text
    assert len(text.splitlines()) < 70, "the pack's help, not the engine's 2,793 lines"


@pytest.mark.parametrize("argv", [["launch", "--help"], ["doctor", "--help"]])
def test_subcommand_help_is_the_packs(capsys, argv):
    with pytest.raises(SystemExit) as done:
        cli.main(argv)
    assert done.value.code == 0
    text = capsys.readouterr().out
    assert text.startswith(f"usage: sglang-adapters {argv[0]}")
    assert f"{cli.EXIT_FLAGS}   a pack flag not understood" in text
    assert "--speculative-algorithm" not in text  # none of the engine's 2,793 lines


def test_an_adapters_command_is_a_command_of_the_pack(capsys):
    """`sglang-adapters build-kernel` (folded_fence's): listed in the help, handed its own
    arguments, its statuses the pack's: 64 a usage error, 78 a value not understood."""
    assert set(cli.adapter_commands()) == {"build-kernel"}
    assert not {"doctor", "launch", "canary", "version"} & set(cli.adapter_commands())
    with pytest.raises(SystemExit):
        cli.main(["--help"])
    assert re.search(r"^    build-kernel +compile the fence's kernel library", capsys.readouterr().out, re.M)
    assert cli.main(["build-kernel", "--help"]) == 0
    assert capsys.readouterr().out.startswith("usage: sglang-adapters build-kernel ")
    assert cli.main(["build-kernel", "--no-such-option"]) == cli.EXIT_USAGE
    assert cli.main(["build-kernel", "--allow-clones", "yes"]) == cli.EXIT_FLAGS
    assert "--allow-clones (ALLOW_CLONE_FENCE) must be 0 or 1, not 'yes' (exit 78)" in capsys.readouterr().err


def test_version_names_the_pack_and_the_engine(capsys):
    version = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
    with pytest.raises(SystemExit):
        cli.main(["--version"])
    flag_form = capsys.readouterr().out.strip()
    assert cli.main(["version"]) == 0
    assert capsys.readouterr().out.strip() == flag_form
    assert flag_form.startswith(f"sglang-dsv41-adapters {version} (sglang 0.5.23 installed; Python 3.")


def test_a_usage_error_in_the_packs_command_line_is_64(capsys):
    with pytest.raises(SystemExit) as done:
        cli.main(["doctor", "--no-such-option"])
    assert done.value.code == cli.EXIT_USAGE == 64
    with pytest.raises(SystemExit) as done:
        cli.main(["--"])
    assert done.value.code == 64 and "no COMMAND after --" in capsys.readouterr().err


@pytest.mark.parametrize("path", ["/nonexistent/sglang-0.5.23", "README.md", "docs"])
def test_doctor_engine_with_a_bad_path_is_one_line_and_64(path):
    done = run_cli("doctor", "--engine", path, timeout=60)
    assert done.returncode == 64, done.stderr[-2000:]
    (line,) = untimed(done.stderr.strip())
    assert re.match(rf"\[sglang-adapters\] pid=\d+ rank=launcher doctor --engine {re.escape(path)}: ", line), line
    assert line.endswith("(exit 64)")


def test_a_reader_that_leaves_early_is_no_error():
    """`doctor | head`: the reader closes the pipe before the report is written (here before
    doctor starts); no traceback, and the verdict's status."""
    path = f"{pathlib.Path(python()).parent}{os.pathsep}{os.environ['PATH']}"
    read, write = os.pipe()
    os.close(read)  # the reader has left
    with os.fdopen(write, "w") as left:
        done = zygote.run([python(), "entrypoint.py", "doctor", "--strict"], cwd=ROOT, stdout=left,
                          stderr=subprocess.PIPE, env=engine_env("0.5.23", PATH=path), text=True, timeout=240)
    assert done.returncode == 0 and "Traceback" not in done.stderr, done.stderr[-2000:]


@pytest.mark.parametrize("args, flags", [(["doctor"], {}), (["--", "python3", "-c", "print('ran')"],
                                                               {"DSV41_FOLDED_FENCE": "1"})])
def test_an_engine_that_cannot_be_imported_is_one_line_and_69(args, flags, tmp_path):
    """A non-root pod with a read-only root file system: HOME=/proc, where torch cannot make its
    cache folder while the engine imports. A plain process (the zygote's engine is imported already)."""
    env = {**engine_env("0.5.23", HOME="/proc", **flags), "PATH": f"{pathlib.Path(python()).parent}{os.pathsep}{os.environ['PATH']}"}
    for name in [n for n in env if n in ("XDG_CACHE_HOME", "TORCH_HOME") or n.startswith(("TORCHINDUCTOR_", "TRITON_"))]:
        del env[name]  # a cache folder torch set up in this test process would spare the child its home
    done = subprocess.run([python(), "entrypoint.py", *args], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=240)
    assert done.returncode == cli.EXIT_REFUSED == 69, done.stderr[-3000:]
    assert "Traceback" not in done.stderr and "ran" not in done.stdout
    (fatal,) = [line for line in done.stderr.splitlines() if "cannot be imported" in line]
    assert "FileNotFoundError" in fatal and "'/proc/.cache'" in fatal, fatal
    assert "fix: /proc/.cache cannot be made or read: point HOME" in fatal and fatal.endswith("(exit 69)")


# --- the wrapper, with real commands ----------------------------------------------------------

def test_the_wrapper_passes_the_commands_status_through_and_execs_it():
    done = run_cli("python", "-c", "import os; print(os.getpid()); raise SystemExit(7)", DSV41_FOLDED_FENCE="1")
    assert done.returncode == 7, done.stderr[-3000:]
    lines = pack_lines(done.stderr)
    assert [line.split()[3] for line in lines] == ["deployment:", *ADAPTERS]
    # exec: the command runs as the very process that checked and applied (same pid).
    assert all(line.startswith(f"[sglang-adapters] pid={done.stdout.strip()} rank=launcher ") for line in lines), lines
    assert "folded_fence DSV41_FOLDED_FENCE='1': APPLIED" in done.stderr


@pytest.mark.parametrize("command", [["--", "python3", "-m", "sglang.launch_server"], ["sglang", "serve"]])
def test_the_wrapper_runs_the_engines_own_server(command):
    done = run_cli(*command, "--help", DSV41_SPEC_TP_SYNC="all")
    assert done.returncode == 0, done.stderr[-3000:]
    assert "--speculative-algorithm" in done.stdout and "--model-path" in done.stdout
    assert "rank0_broadcast DSV41_SPEC_TP_SYNC='all': SUPERSEDED" in done.stderr


def test_the_wrapper_hands_the_selection_to_the_command():
    code = "import os; print(os.environ.get('SGLANG_SPEC_TP_SYNC'))"
    done = run_cli("python", "-c", code, DSV41_SPEC_TP_SYNC="all,-dspark-draft")
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip() == "all,-dspark-draft"  # the selection in the engine's own grammar


def test_the_wrapper_stops_before_the_command_on_a_flag_error():
    done = run_cli("python", "-c", "print('ran')", DSV4_FOLDED_FENCE="1", timeout=60)
    assert done.returncode == cli.EXIT_FLAGS == 78
    assert "ran" not in done.stdout
    assert "DSV4_FOLDED_FENCE is not a flag of this pack; did you mean DSV41_FOLDED_FENCE?" in done.stderr


def test_the_wrapper_warns_when_the_commands_python_is_not_the_one_it_judged():
    """Outside the image: the venv's engine judged, then a system python3 without it."""
    system = "/usr/bin/python3"
    if not os.access(system, os.X_OK) or subprocess.run([system, "-c", "import sglang"], capture_output=True).returncode == 0:
        pytest.skip(f"no {system} without sglang here")
    other = run_cli("--", system, "-c", "print('ran')", timeout=120)
    same = run_cli("--", "python3", "-c", "print('ran')", timeout=120)  # the venv's, first on PATH
    assert other.returncode == same.returncode == 0 and other.stdout == same.stdout == "ran\n", other.stderr[-2000:]
    (warning,) = [line for line in pack_lines(other.stderr) if " warning: " in line]
    assert f"warning: {system} runs {system}, which imports no sglang; the checks above judged the sglang at " in warning
    assert f"run COMMAND with {python()}" in warning
    assert not [line for line in pack_lines(same.stderr) if " warning: " in line]


@pytest.mark.parametrize("argv, usage, near", [(["doctor", "--jsno"], "doctor", "--json"),
                                               (["canary", "--canary", "http://x", "--windw", "5"], "canary", "--window")])
def test_a_mistyped_option_gets_its_commands_usage_and_a_suggestion(capsys, argv, usage, near):
    with pytest.raises(SystemExit) as done:
        cli.main(argv)
    assert done.value.code == cli.EXIT_USAGE
    err = capsys.readouterr().err
    assert err.startswith(f"usage: sglang-adapters {usage} ") and f"; did you mean {near}?\n" in err, err


def test_a_missing_command_is_127():
    done = run_cli("no-such-command-for-sglang-adapters", "--x", timeout=60)
    assert done.returncode == 127
    assert "rank=launcher no-such-command-for-sglang-adapters: command not found\n" in done.stderr


# --- one exit-status table for launch, the wrapper and doctor --strict ------------------------

CASES = {
    "flag value": ({"DSV41_FOLDED_FENCE": "maybe"}, 78),
    "near-miss name": ({"dsv41_folded_fence": "1"}, 78),
    "master switch value": ({"DSV41_ADAPTERS": "on"}, 78),
    "log format value": ({"DSV41_ADAPTERS_LOG": "yaml"}, 78),
    "flag error and conflict": ({"DSV41_GROUP_MIN_MEN": "1", "DSV41_SPEC_TP_SYNC": "all", "SGLANG_SPEC_TP_SYNC": "init"}, 78),
    "conflict with the engine's switch": ({"DSV41_SPEC_TP_SYNC": "all", "SGLANG_SPEC_TP_SYNC": "init"}, 69),
    "ranks would skip the plugin": ({"DSV41_FOLDED_FENCE": "1", "SGLANG_PLUGINS": "other"}, 69),
}


@pytest.fixture
def environ(monkeypatch):
    """A clean pack environment for in-process runs, and a fresh per-process decision. The pack's settings stay
    (the run's proof cache: never the user's)."""
    for key in list(os.environ):
        if (runtime.unknown_flags({key: ""}) or key in runtime.pack_flags() or key.startswith(("SGLANG_SPEC", "SGLANG_PLUGINS"))) \
                and key not in settings.NAMES:
            monkeypatch.delenv(key)
    runtime.reset()

    def set_env(values):
        for key, value in values.items():
            monkeypatch.setenv(key, value)
    return set_env


@pytest.mark.parametrize("case", sorted(CASES))
def test_launch_wrapper_and_strict_doctor_exit_alike(environ, monkeypatch, capsys, case):
    env, status = CASES[case]
    environ(env)
    # Every case is refused before anything starts; were one not, nothing may replace pytest.
    monkeypatch.setattr(os, "execvp", lambda *a: pytest.fail(f"the wrapper ran {a}"))
    monkeypatch.setattr(cli.runpy, "run_module", lambda *a, **k: pytest.fail("the server ran"))
    got = {}
    for form, argv in (("launch", ["launch", "--model-path", "/nonexistent"]),
                       ("bare server arguments", ["--model-path", "/nonexistent"]),
                       ("wrapper", ["--", "python", "-c", "raise SystemExit(0)"])):
        runtime.reset()
        got[form] = cli.main(argv)  # refused before the server or the command starts
    got["doctor --strict"] = cli.main(["doctor", "--strict"])
    got["doctor"] = cli.main(["doctor"])
    got["doctor --exit-zero"] = cli.main(["doctor", "--exit-zero"])
    for argv in (["--help"], ["launch", "--help"], ["doctor", "--help"], ["doctor", "--strict", "-h"]):
        with pytest.raises(SystemExit) as done:
            cli.main(argv)  # the help is printed whatever the flags; a flag not understood is 78 too
        got[" ".join(argv)] = done.value.code
    helps = status if status == cli.EXIT_FLAGS else 0
    assert got == {"launch": status, "bare server arguments": status, "wrapper": status,
                   "doctor --strict": status, "doctor": status, "doctor --exit-zero": 0,
                   "--help": helps, "launch --help": helps, "doctor --help": helps, "doctor --strict -h": helps}
    out = capsys.readouterr().out  # the verdict first, in every form of doctor
    word = 'flag-error' if status == 78 else 'refused'
    assert out.startswith(f"verdict: {word} (exit {status})\n")
    assert f"\nverdict: {word} (exit 0 with --exit-zero; the verdict's status is {status})\n" in out


@pytest.mark.parametrize("argv", [["launch", "--help"], ["doctor", "--help"], ["--help"]])
def test_help_with_a_flag_not_understood_is_the_help_then_one_line_and_78(argv):
    done = run_cli(*argv, DSV41_FOLDED_FENCE="maybe", timeout=60)
    assert done.returncode == cli.EXIT_FLAGS, done.stderr[-3000:]
    assert done.stdout.startswith(f"usage: sglang-adapters {argv[0] if argv[0] != '--help' else ''}")
    (line,) = pack_lines(done.stderr)
    assert line.endswith(f"rank=launcher {' '.join(argv)}: DSV41_FOLDED_FENCE='maybe' is not understood; accepted "
                         "values are 1/on/true/yes/y to switch it on and 0/off/false/none/no/n to switch it off (any case, no "
                         "spaces), or leave DSV41_FOLDED_FENCE unset for off (exit 78)"), line
    off = run_cli(*argv, DSV41_FOLDED_FENCE="maybe", DSV41_ADAPTERS="off", timeout=60)  # no flag is read: as launch
    assert off.returncode == 0 and off.stdout == done.stdout and pack_lines(off.stderr) == []


@pytest.mark.parametrize("env", [case[0] for case in CASES.values()] + [{"DSV41_ADAPTERS": "off", "DSV41_FOLDED_FENCE": "2"}])
def test_the_flag_check_of_help_is_the_decisions(env):
    assert runtime.flag_errors(env) == list(runtime.decide(env).flag_errors)


def test_the_engines_own_argument_error_stays_2():
    done = run_cli("--model-path", "/nonexistent", "--no-such-engine-argument", timeout=240)
    assert done.returncode == 2
    assert "unrecognized arguments: --no-such-engine-argument" in done.stderr


# --- doctor --json and its schema ---------------------------------------------------------------

def schema_errors(value, schema=SCHEMA) -> list[str]:
    """What `value` breaks of `schema` (JSON Schema 2020-12, the jsonschema library)."""
    import jsonschema

    validator = jsonschema.Draft202012Validator(schema, format_checker=jsonschema.FormatChecker())
    return sorted(f"{error.json_path}: {error.message}" for error in validator.iter_errors(value))


def test_the_schema_is_a_schema_and_its_check_can_fail():
    import jsonschema

    jsonschema.Draft202012Validator.check_schema(SCHEMA)
    report = {"schema_version": 1, "pack": {"name": "sglang-dsv41-adapters", "version": "0.1.0"}}
    errors = schema_errors(report | {"verdict": "maybe"})
    assert "$: 'engine' is a required property" in errors
    assert "$.verdict: 'maybe' is not one of ['ok', 'flag-error', 'refused']" in errors
    assert "$.value: True is not of type 'string', 'null'" in schema_errors(
        {"value": True}, SCHEMA["properties"]["adapters"]["items"])
    # the one-line reasons added after 0.1.0: described, typed, and (additive) not required
    adapter = SCHEMA["properties"]["adapters"]["items"]
    for where in (adapter, adapter["properties"]["engine_check"]):
        assert "short_reason" in where["properties"] and "short_reason" not in where["required"]
    assert "$.short_reason: 3 is not of type 'string'" in schema_errors({"short_reason": 3}, adapter)
    assert "$.short_reason: 3 is not of type 'string'" in schema_errors(
        {"outcome": "applied", "reason": "", "short_reason": 3}, adapter["properties"]["engine_check"])


def test_fields_added_within_schema_version_1_validate():
    """The schema promises additive changes within a version: a report of this version with a
    field this file does not know yet, at any level, still validates."""
    done = run_cli("doctor", "--json", DSV41_FOLDED_FENCE="1")
    report = json.loads(done.stdout)
    assert schema_errors(report) == []
    report["added_later"] = {"any": ["shape"]}
    report["pack"]["build"] = "abc"
    report["engine"]["digest"] = "sha256:..."
    report["adapters"][0]["cost_us"] = 1.5
    report["adapters"][0]["engine_check"]["since"] = "0.5.19"
    report["ranks"]["labels"] = ["0", "1"]
    assert schema_errors(report) == []
    report["verdict"] = 3  # a retyped field is no addition
    assert schema_errors(report) == ["$.verdict: 3 is not one of ['ok', 'flag-error', 'refused']"]


@pytest.mark.parametrize("args,env,verdict", [
    ((), {"DSV41_FOLDED_FENCE": "1", "DSV41_SPEC_TP_SYNC": "all,-dspark-draft"}, "ok"),
    ((), {"DSV41_FOLDED_FENCE": "", "DSV41_ADAPTERS_LOG": "json"}, "flag-error"),
    ((), {"DSV41_ADAPTERS": "off", "DSV41_FOLDED_FENCE": "1"}, "ok"),
    (("--engine", "0.5.16"), {"DSV41_SPEC_TP_SYNC": "all"}, "refused"),
])
def test_doctor_json_matches_its_schema(args, env, verdict):
    if args:
        args = ("--engine", str(release_sources(args[1])))
    done = run_cli("doctor", "--json", "--strict", "--require", "all", *args, **env)
    report = json.loads(done.stdout)
    assert schema_errors(report) == []
    assert (report["verdict"], report["strict_exit_status"], done.returncode) == (verdict, *[cli.VERDICT_STATUS[verdict]] * 2)
    assert report["pack"]["version"] == tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
    rows = {r["flag"]: r for r in report["adapters"]}
    assert [r["adapter"] for r in report["adapters"]] == list(ADAPTERS)
    for flag, value in env.items():
        if flag in rows:
            assert rows[flag]["value"] == value  # an empty value stays "", never blank or null
    if args:
        assert report["engine"] == {"version": "0.5.16", "source": "path", "path": args[1], "released": True,
                                    "version_source": f"{args[1]}/sglang/_version.py", "judged_by": "code"}
        assert report["ranks"]["checked"] is True  # 0.5.16's plugin loader is the same code as the installed one's
    else:
        assert report["engine"]["source"] == "installed" and report["engine"]["version"] == "0.5.23"
        assert report["engine"]["version_source"] == f"{report['engine']['path']}/_version.py"
    if verdict == "ok" and not report["switched_off"]:
        assert rows["DSV41_SPEC_TP_SYNC"]["setting"] == [
            "1:dspark-mem", "7:dspark-plan", "8:dspark-accept-greedy", "9:dspark-accept-sample", "10:dspark-accept-graph",
            "11:dspark-target", "12:dflash-mem", "13:dflash-selector", "14:dflash-accept-sample", "15:dflash-accept-greedy",
            "16:dflash-target"]
        assert rows["DSV41_FOLDED_FENCE"]["setting"] is True


def test_doctor_table_shows_an_empty_value_as_quotes():
    done = run_cli("doctor", DSV41_SPEC_TP_SYNC="", DSV41_FOLDED_FENCE="on")
    rows = {line.split()[0]: line.split() for line in done.stdout.splitlines()[5:9]}  # under the verdict and the engine header
    assert rows["rank0_broadcast"][:4] == ["rank0_broadcast", "DSV41_SPEC_TP_SYNC", "''", "off"]
    assert rows["folded_fence"][:4] == ["folded_fence", "DSV41_FOLDED_FENCE", "'on'", "applied"]


# --- the per-process lines --------------------------------------------------------------------

def all_lines(environ: dict, engine) -> list[str]:
    decision = runtime.decide(environ, engine)
    return decision.lines("text")


LINE_CASES = [c | fence for c in combos() for fence in ({}, {"DSV41_FOLDED_FENCE": "1"}, {"DSV41_FOLDED_FENCE": "maybe"})] + [
    {"DSV41_SPEC_TP_SYNC": "all,-dspark-draft," * 20}, {"DSV41_SPEC_TP_SYNC": "all", "SGLANG_SPEC_TP_SYNC": "init"},
    {"DSV41_SPEC_TP_SYNC": "no-such-site"}, {"DSV41_ADAPTERS": "off"},
]


@pytest.mark.timeout(600)
@pytest.mark.parametrize("release", ["installed", "0.5.16", "0.5.18"])
def test_every_line_is_one_line_under_200_characters(release):
    engine = None if release == "installed" else SourceEngine(release_sources(release))
    states = set()
    for environ in LINE_CASES:
        decision = runtime.decide(environ, engine)
        states |= {(o.adapter, o.state) for o in decision.outcomes}
        for line in decision.lines("text"):
            assert len(line) < 200 and "\n" not in line, line
            assert line.startswith(f"{runtime.PREFIX} pid={os.getpid()} ") and line.endswith(f" (sglang {decision.engine})")
    # every adapter reached every outcome its releases have (the check covers them all)
    assert {s for a, s in states} >= {runtime.OFF, runtime.APPLIED, runtime.REFUSED}, states


def test_json_lines_for_log_pipelines():
    done = run_cli("python", "-c", "pass", DSV41_ADAPTERS_LOG="json", DSV41_FOLDED_FENCE="1")
    assert done.returncode == 0, done.stderr[-3000:]
    objects = [json.loads(line) for line in done.stderr.splitlines() if line.startswith('{"pack":"sglang-adapters"')]
    progress = [o for o in objects if "progress" in o]  # as many as the machine's speed makes
    assert all(o["message"].startswith("progress: ") for o in progress)
    objects = [o for o in objects if "progress" not in o]
    assert [o.get("adapter", "deployment") for o in objects] == ["deployment", *ADAPTERS]
    assert objects[0]["deployment"] == "every layout" and "does not start the engine's server" in objects[0]["judged_from"]
    fence = objects[1]
    assert (fence["flag"], fence["value"], fence["outcome"], fence["engine"]) == ("DSV41_FOLDED_FENCE", "1", "applied", "0.5.23")
    assert "DSparkWorkerV2._block_accept_lens" in fence["reason"]  # the whole reason, not the shortened one
    assert objects[0]["message"].startswith("deployment: every layout (")
    for o in objects[1:]:
        assert o["message"].startswith(f"{o['adapter']} {o['flag']}=")
    for o in objects:
        assert o["rank"] == "launcher" and o["pid"] > 0
        assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z", o["time"]), o["time"]


def test_json_mode_covers_every_line_the_fatal_one_too():
    """A refusal and a missing command: every line the pack prints is one JSON object."""
    refused = run_cli("python", "-c", "pass", DSV41_ADAPTERS_LOG="json", DSV41_FOLDED_FENSE="1", timeout=120)
    missing = run_cli("no-such-command-for-sglang-adapters", DSV41_ADAPTERS_LOG="json", timeout=120)
    assert (refused.returncode, missing.returncode) == (78, 127)
    for done in (refused, missing):
        ours = [line for line in done.stderr.splitlines() if "sglang-adapters" in line]
        assert ours and all(line.startswith('{"pack":"sglang-adapters","time":"') for line in ours), ours
    fatal = json.loads(refused.stderr.splitlines()[-1])
    assert fatal["fatal"] is True and fatal["message"].startswith("the engine must not start: DSV41_FOLDED_FENSE is not")
    assert json.loads(missing.stderr.splitlines()[-1])["message"] == "no-such-command-for-sglang-adapters: command not found"


def test_master_switch_is_one_line_and_applies_nothing():
    done = run_cli("python", "-c", "import os; print(os.environ.get('SGLANG_SPEC_TP_SYNC'))", DSV41_ADAPTERS="off",
               DSV41_FOLDED_FENCE="1", DSV41_SPEC_TP_SYNC="rng", DSV41_GROUP_MIN_MEM="yes", timeout=60)
    assert done.returncode == 0 and done.stdout.strip() == "None", done.stderr[-2000:]
    (line,) = pack_lines(done.stderr)
    assert re.fullmatch(r"\[sglang-adapters\] pid=\d+ rank=launcher DSV41_ADAPTERS='off': OFF - the whole pack is off: .* "
                        r"\(sglang 0\.5\.23\)", line)


# --- near-miss flag names -------------------------------------------------------------------------

@pytest.mark.parametrize("name,flag", [
    ("dsv41_folded_fence", "DSV41_FOLDED_FENCE"), ("DSV4_FOLDED_FENCE", "DSV41_FOLDED_FENCE"),
    ("DSV41_FOLDED_FENSE", "DSV41_FOLDED_FENCE"), ("DSV41_SPEC_TP_SYN", "DSV41_SPEC_TP_SYNC"),
    ("DSV41_GROUP_MIN_MEMORY", "DSV41_GROUP_MIN_MEM"), ("DSV41_ADAPTER", "DSV41_ADAPTERS"),
    ("SV41_FOLDED_FENCEE", "DSV41_FOLDED_FENCE"), ("Dsv41_Adapters_Log", "DSV41_ADAPTERS_LOG"),
])
def test_a_near_miss_name_is_a_startup_error_naming_the_flag(name, flag):
    decision = runtime.decide({name: "1"}, names=())
    assert decision.refused and decision.flag_errors == decision.problems
    (problem,) = decision.problems
    assert problem.startswith(f"{name} is not a flag of this pack; did you mean {flag}?")


def test_names_three_edits_away_are_left_alone():
    assert runtime.unknown_flags({"XSV4_FOLDED_FENCEX": "1", "FOLDED_FENCE": "1", "SGLANG_SPEC_TP_SYNC": "all"}) == []


def engine_variable_names() -> set[str]:
    """Every name the engine documents as an environment variable (sglang.srt.environ's
    Envs), and every upper-case string literal in its sources that could be one."""
    import sglang
    import sglang.srt.environ as environ

    names = {k for k, v in vars(type(environ.envs)).items() if isinstance(v, environ.EnvField)}
    for path in pathlib.Path(sglang.__file__).parent.rglob("*.py"):
        names |= set(re.findall(r"""["']([A-Z][A-Z0-9_]{3,40})["']""", path.read_text(errors="replace")))
    return names


# What a container of the official image sets besides the engine's own (its Dockerfile, the
# NVIDIA runtime, docker itself) and the pack's image adds.
CONTAINER = ("NVIDIA_VISIBLE_DEVICES", "NVIDIA_DRIVER_CAPABILITIES", "NVIDIA_REQUIRE_CUDA", "NV_CUDA_LIB_VERSION",
             "CUDA_VERSION", "CUDA_HOME", "LD_LIBRARY_PATH", "HOSTNAME", "HOME", "PATH", "LANG", "TERM",
             "PYTHONUNBUFFERED", "DEBIAN_FRONTEND", "PIP_BREAK_SYSTEM_PACKAGES", "SGLANG_ADAPTERS_SNAPSHOT_KERNEL",
             "DSV41_ADAPTERS_SNAPSHOT_KERNEL",
             "TORCH_CUDA_ARCH_LIST", "NCCL_DEBUG", "MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "LOCAL_RANK")


def test_the_engines_and_this_machines_variables_do_not_trip_it():
    names = engine_variable_names()
    assert len(names) > 700 and "SGLANG_SPEC_TP_SYNC" in names and "CUDA_VISIBLE_DEVICES" in names
    environ = {name: "1" for name in names} | {name: "1" for name in CONTAINER} | dict(os.environ)
    environ = {k: v for k, v in environ.items() if k not in runtime.pack_flags()}
    assert runtime.unknown_flags(environ) == []


def test_did_you_mean_for_a_selector_token():
    decision = runtime.decide({"DSV41_SPEC_TP_SYNC": "all,-dspark-mme"}, names=("rank0_broadcast",))
    assert "unknown token 'dspark-mme' (did you mean 'dspark-mem'?)" in decision.outcomes[0].reason
    assert decision.flag_errors == (decision.outcomes[0].reason,)


def test_a_conflict_names_the_sites_as_the_flags_write_them():
    decision = runtime.decide({"DSV41_SPEC_TP_SYNC": "all", "SGLANG_SPEC_TP_SYNC": "init"}, names=("rank0_broadcast",))
    reason = decision.outcomes[0].reason
    assert "SGLANG_SPEC_TP_SYNC: ='init' selects sites 1,12 but DSV41_SPEC_TP_SYNC='all' selects 1,7,8,9," in reason
    assert "[" not in reason and decision.flag_errors == ()


# --- the deployment: doctor -- COMMAND, the wrapper ---------------------------------------------

SERVER = ["python3", "-m", "sglang.launch_server", "--model-path", "/models/m", "--tp-size", "4"]


@pytest.mark.parametrize("release", ["0.5.23", "0.5.18"])
@pytest.mark.parametrize("extra,attn_dp", [([], 1), (["--enable-dp-attention", "--dp-size", "4"], 4),
                                           (["--enable-dp-attention", "--dp-size", "2"], 2)])
def test_doctor_judges_the_commands_deployment_without_running_it(release, extra, attn_dp):
    done = run_cli("doctor", "--json", "--", *SERVER, *extra, "--speculative-algorithm", "DSPARK", release=release)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout)
    assert schema_errors(report, SCHEMA) == []
    assert report["deployment"] == {"tp_size": 4, "attn_dp_size": attn_dp, "attn_cp_size": 1, "attn_tp_size": 4 // attn_dp,
                                    "speculative_algorithm": "DSPARK",
                                    # what the adapters read of the command (their surfaces' server_args)
                                    "server_args": {"speculative_algorithm": "DSPARK", "speculative_dspark_block_size": None,
                                                    "speculative_num_draft_tokens": None},
                                    "judged_from": "the command's server arguments, read with the engine's own parser"}
    assert report["by_layout"] == {}  # one deployment judged: no per-layout rows
    assert not [line for line in untimed(done.stderr) if "[sglang-adapters]" in line]  # nothing applied, nothing started


def test_doctor_without_a_command_says_the_outcomes_hold_for_every_layout():
    done = run_cli("doctor")
    assert done.returncode == 0, done.stderr[-3000:]
    assert "deployment: none given (doctor -- COMMAND judges one); the outcomes above hold for every layout" in done.stdout
    report = json.loads(run_cli("doctor", "--json").stdout)
    assert report["deployment"] is None and schema_errors(report, SCHEMA) == []
    for adapter in report["adapters"]:
        assert adapter["short_reason"] and adapter["engine_check"]["short_reason"]


@pytest.mark.parametrize("command,why", [
    (["python3", "-c", "1"], "python3 does not start the engine's server"),
    ([*SERVER, "--tp-size", "four"], "the engine's argument parser rejects the server arguments (argument --tp-size"),
])
def test_doctor_refuses_a_command_it_cannot_judge_with_64(command, why):
    done = run_cli("doctor", "--", *command)
    assert done.returncode == cli.EXIT_USAGE
    assert why in done.stderr and done.stdout == ""


def test_the_wrapper_says_which_deployment_it_judged():
    done = run_cli("--", "python3", "-c", "print('ran')", DSV41_FOLDED_FENCE="1")
    assert done.returncode == 0 and done.stdout == "ran\n"
    assert "deployment: every layout (python3 does not start the engine's server)" in done.stderr
    parsed = zygote.run(
        [python(), "-c", "import sys; from sglang_dsv41_adapters.framework import runtime, topology; "
         "print(topology.from_command(sys.argv[1:])[0].describe())", *SERVER, "--enable-dp-attention", "--dp-size", "4"],
        cwd=ROOT, env=engine_env("0.5.23"), capture_output=True, text=True, timeout=240)
    assert parsed.stdout.strip() == "TP 4, DP attention 4 x attention-TP 1", parsed.stderr[-2000:]
