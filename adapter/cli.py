"""The pack's command line: the console script `sglang-adapters` and the image's ENTRYPOINT.

    sglang-adapters                            the doctor report (no arguments)
    sglang-adapters doctor [--json] [--strict] [--require SPEC] [--record PATH] [--exit-zero] [--verbose]
                           [--engine PATH] [ADAPTER ...] [-- COMMAND ...]
    sglang-adapters [--] COMMAND ARGS...       wrapper: check flags and engine, apply here, exec COMMAND
    sglang-adapters launch SERVER-ARGS...      the engine's server in this process, after the same check;
    sglang-adapters --model-path ...           bare server arguments are a shorthand for it
    sglang-adapters canary --canary URL [--baseline URL] [--json] [...]
                                               a canary judged against a baseline (adapter/rollout)
    sglang-adapters version | --version | --help
    sglang-adapters build-kernel [--archs ...]  an adapter's own command (folded_fence: its kernel file)

Exit statuses: EXIT_STATUSES below, one table for launch, the wrapper and doctor --strict.
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import importlib.metadata
import importlib.util
import json
import os
import re
import runpy
import shutil
import subprocess
import sys
import tempfile
import textwrap

from . import ADAPTERS, load
from .engine import settings
from .engine.installed import EngineImportError, InstalledEngine, engine_version, installed_package
from .engine.source_engine import UNRELEASED, open_engine
from .framework import delivery, progress, required, runtime, topology

SERVER_MODULE = "sglang.launch_server"
DIST = "sglang-dsv41-adapters"
SCHEMA_VERSION = 1  # of `doctor --json` (docs/doctor-report.schema.json): bump on any incompatible change

# Distinct from 1 (an uncaught Python error) and 2 (the engine's own argument parser), and
# from the wrapped command's statuses, which pass through unchanged.
EXIT_OK = 0
EXIT_USAGE = 64  # sysexits EX_USAGE
EXIT_REFUSED = 69  # sysexits EX_UNAVAILABLE
EXIT_FLAGS = 78  # sysexits EX_CONFIG
EXIT_CANNOT_RUN, EXIT_NOT_FOUND = 126, 127  # as a shell says it
EXIT_STATUSES = (
    (EXIT_OK, "checked and started (launch, wrapper: then the command's own status, unchanged); "
              "doctor: nothing set or required refused"),
    (EXIT_USAGE, "the pack's own command line: an unknown option, no command after --, "
                 "doctor --engine PATH missing or unreadable"),
    (EXIT_REFUSED, "refused: an engine that drifted from what an adapter needs, conflicting flags, "
                   "ranks that would not load the pack (doctor --strict: even with every flag off), an installed "
                   "engine that raises when imported"),
    (EXIT_FLAGS, "a pack flag not understood: a DSV41_* value or name, or a name within two edits of a "
                 "flag (checked first; --help prints its help, then says so)"),
    (EXIT_CANNOT_RUN, "wrapper: COMMAND found but not executable"),
    (EXIT_NOT_FOUND, "wrapper: COMMAND not found"),
)
VERDICT_STATUS = {"ok": EXIT_OK, "flag-error": EXIT_FLAGS, "refused": EXIT_REFUSED}


def pack_version() -> str:
    try:
        return importlib.metadata.version(DIST)
    except importlib.metadata.PackageNotFoundError:
        return "unknown (not installed)"


def version_text() -> str:
    try:
        engine = f"sglang {engine_version()} installed"
    except Exception as exc:  # no engine here: still say what the pack is
        engine = f"no sglang installed ({type(exc).__name__})"
    return f"{DIST} {pack_version()} ({engine}; Python {sys.version.split()[0]})"


# --- the parser -----------------------------------------------------------------------------

class Parser(argparse.ArgumentParser):
    def error(self, message):
        self.print_usage(sys.stderr)
        self.exit(EXIT_USAGE, f"{self.prog}: error: {message}\n")


FLAG_WIDTH = 28  # the longest flag name and two spaces


def flags_help() -> str:
    lines = []
    for name in ADAPTERS:
        adapter = load(name)
        lines.append(_item(adapter.flag, f"{name}: {adapter.summary}", FLAG_WIDTH))
        lines += [_item(flag, text, FLAG_WIDTH) for flag, text in adapter.extra_flags.items()]
    lines += [
        _item(runtime.MASTER, "off: the whole pack is off in the launcher and every rank (the rollback)", FLAG_WIDTH),
        _item(runtime.LOG_FORMAT, "json: the per-process lines as JSON objects; text (default)", FLAG_WIDTH),
        f"  {settings.PROOF_CACHE}, {settings.SNAPSHOT_KERNEL}: the proof cache's folder (or off)",
        "  and the fence's kernel file (their old SGLANG_ADAPTERS_* names are still read).",
        "  Switches take 1/on/true/yes/y and 0/off/false/none/no/n, any case; DSV41_SPEC_TP_SYNC upstream's",
        "  site selector (all, init, rng, site slugs or numbers, -site); unset is off. Any other value, a",
        "  DSV41_* name that is no flag, or a name within two edits of one is a start-up error.",
    ]
    return "\n".join(lines)


def statuses_help() -> str:
    return "\n".join(_item(str(code), meaning, 5) for code, meaning in EXIT_STATUSES)


def _item(key: str, text: str, width: int) -> str:
    return textwrap.fill(f"{key:<{width}}{text}", 100, initial_indent="  ", subsequent_indent=" " * (width + 2))


def build_parser() -> Parser:
    # The first load of the adapters imports torch, seconds in which an import holds the interpreter: said at once.
    first = 0 if load.cache_info().currsize < len(ADAPTERS) else progress.FIRST
    with progress.step("starting: loading the pack's adapters (torch is imported first)", first=first):
        return _build_parser()


def _build_parser() -> Parser:
    parser = Parser(
        prog="sglang-adapters",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description="The SGLang adapter pack: runtime fixes for tensor-parallel divergence in speculative "
                    "decoding\n(DSpark, DFlash) on sglang 0.5.16-0.5.23, switched per deployment with "
                    "environment flags.\nA flag does exactly what it says in the launcher and in every TP "
                    "rank, or the engine does not start.",
        epilog="forms:\n"
               "  sglang-adapters                          the doctor report\n"
               "  sglang-adapters [--] COMMAND [ARGS...]   check flags and engine, apply the adapters here, then\n"
               "                                           exec COMMAND (sglang serve ..., python3 -m "
               "sglang.launch_server ...)\n"
               "  sglang-adapters --model-path ... [...]   bare server arguments: shorthand for launch\n\n"
               f"flags (environment variables):\n{flags_help()}\n\n"
               f"exit statuses (launch, the wrapper, doctor --strict):\n{statuses_help()}\n"
               "  The engine's own argument errors stay 2; a wrapped command's status is its own.",
    )
    parser.add_argument("--version", action="version", version=version_text())
    extra = adapter_commands()
    commands = parser.add_subparsers(dest="command",
                                     metavar="{" + ",".join(["doctor", "launch", "canary", "version", *extra]) + "}")
    doctor_parser = commands.add_parser("doctor", help="report every adapter against the engine (the default)",
                                        **DOCTOR_HELP)
    doctor_options(doctor_parser)
    doctor_parser.add_argument(
        "command", nargs=argparse.REMAINDER, metavar="ADAPTER ... -- COMMAND",
        help="ADAPTER: an adapter's name or flag, one or more: the full report of just those (exit "
             f"{EXIT_FLAGS} for a name that is neither); -- COMMAND: judge the deployment this command would start "
             "(its server arguments, read with the engine's own parser; nothing is run); without it, every adapter "
             "whose verdict depends on the deployment is shown per representative layout")
    doctor_parser.set_defaults(run=doctor)
    commands.add_parser(
        "launch", help="check, apply here, then run the engine's server with SERVER-ARGS in this process",
        usage="sglang-adapters launch SERVER-ARGS...",
        description="Check every flag and the engine, apply the adapters in this process, then run "
                    f"`python -m {SERVER_MODULE} SERVER-ARGS...` here with the arguments unchanged. Every "
                    "argument after `launch` is the engine's (its help: sglang-adapters python3 -m "
                    f"{SERVER_MODULE} --help).",
        epilog=f"exit statuses:\n{statuses_help()}\n  The server's own statuses (2 for its argument errors) "
               "pass through.", formatter_class=argparse.RawDescriptionHelpFormatter)
    from .rollout import canary, verdict

    canary_parser = commands.add_parser(
        "canary", help="judge a canary against a baseline: their metrics over a window, their answers to a prompt set",
        description=textwrap.fill(
            "Judge a canary server (the pack on) against a baseline (the same model and traffic, the pack off) from "
            "outside both: their Prometheus /metrics over a window (restarts, NaN, missing ranks, accept length, ranks "
            "alike, progress, the canary against the baseline) and their answers at temperature 0 to a fixed prompt "
            "set with opaque identifiers to repeat verbatim (the canary against the baseline's own run-to-run "
            "difference). Progress on stderr; the verdict on stdout.", 100),
        epilog="exit statuses:\n" + "\n".join(_item(str(code), meaning, 5) for code, meaning in verdict.EXIT_STATUSES),
        formatter_class=argparse.RawDescriptionHelpFormatter)
    canary.add_arguments(canary_parser)
    canary_parser.set_defaults(run=run_canary, usage_error=canary_parser.error)
    commands.add_parser("version", help="print the pack's and the engine's versions").set_defaults(
        run=lambda opts: print(version_text()) or EXIT_OK)
    for name, run in extra.items():  # listed here; main() hands them their arguments unparsed
        commands.add_parser(name, help=run.__doc__.strip().splitlines()[0], add_help=False)
    return parser


def adapter_commands() -> dict:
    """The subcommands the adapters bring (their surfaces' `commands`): name -> run(argv) -> status."""
    return {name: run for adapter in ADAPTERS for name, run in load(adapter).commands.items()}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    try:
        return run(argv)
    except EngineImportError as exc:  # one line with the cause and the fix, never a traceback
        runtime.emit(f"{exc} (exit {EXIT_REFUSED})", fatal=True)
        return EXIT_REFUSED


def run(argv: list[str]) -> int:
    if not argv:
        return doctor(build_parser().parse_args(["doctor"]))
    first = argv[0]
    if first == "launch" and argv[1:2] not in (["-h"], ["--help"]):
        return launch(argv[1:])  # every argument after `launch` is the engine's, except a lone --help
    if first in ("doctor", "launch", "canary", "version", "-h", "--help", "--version"):
        opts = parse(argv)
        return opts.run(opts)
    if first == "--":
        if len(argv) == 1:
            build_parser().error("no COMMAND after --")
        return wrap(argv[1:])
    if first.startswith("-"):
        return launch(argv)  # bare server arguments: the engine's server
    command = adapter_commands().get(first)
    return command(argv[1:]) if command else wrap(argv)


def parse(argv: list[str]):
    """The pack's own command line. A help it printed exits as launch, the wrapper and doctor
    --strict do where a pack flag is not understood: EXIT_FLAGS, with the errors in one line."""
    try:
        parser = build_parser()
        opts, extra = parser.parse_known_args(argv)
        if extra:
            unknown(parser, argv, extra)
        return opts
    except SystemExit as done:
        asked = argv[:argv.index("--")] if "--" in argv else argv  # after --: the command's own
        errors = runtime.flag_errors(os.environ) if done.code == 0 and {"-h", "--help"} & set(asked) else []
        if errors:
            runtime.emit(f"{' '.join(asked)}: {' | '.join(errors)} (exit {EXIT_FLAGS})")
            raise SystemExit(EXIT_FLAGS) from None
        raise


def unknown(parser: argparse.ArgumentParser, argv: list[str], extra: list[str]) -> None:
    """An option no parser took: the error of the subcommand it was given to (its usage, not the
    top level's), with the nearest of its options (`doctor --jsno`: did you mean --json?)."""
    commands = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices
    owner = commands.get(argv[0], parser) if argv else parser
    options = [o for action in owner._actions for o in action.option_strings if o.startswith("--")]
    near = difflib.get_close_matches(extra[0], options, n=1)
    owner.error(f"unrecognized arguments: {' '.join(extra)}" + (f"; did you mean {near[0]}?" if near else ""))


# --- doctor ---------------------------------------------------------------------------------

DOCTOR_HELP = dict(
    usage="sglang-adapters doctor [-h] [--json] [--strict] [--require SPEC] [--record PATH] [--exit-zero] [--verbose] "
          "[--engine PATH] [ADAPTER ...] [-- COMMAND ...]",
    description="Report every adapter's outcome under the current flags (the decision the launcher and every rank "
                "take) and its engine check (switched on at its broadest setting): the table, then one line per "
                "adapter with the deciding reason; --verbose or ADAPTER for every proof, site and caller.",
    epilog=f"exit statuses with --strict:\n{statuses_help()}", formatter_class=argparse.RawDescriptionHelpFormatter)


def doctor_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", action="store_true",
                        help=f"print the report as JSON (schema version {SCHEMA_VERSION}: docs/doctor-report.schema.json)")
    parser.add_argument("--strict", action="store_true",
                        help=f"also exit {EXIT_REFUSED} where the ranks could not load the pack, whatever the flags "
                             "(docker build runs this)")
    parser.add_argument("--require", action="append", default=[], metavar="SPEC",
                        help=f"fail ({EXIT_REFUSED}) where these flags, which the image is built to serve, are refused: "
                             "flag or adapter names, @ENV-FILE (its flags set on, at their values) or all; comma "
                             "or space separated, repeatable. Every other adapter's check is printed, never failed on")
    parser.add_argument("--record", metavar="PATH",
                        help="also write the JSON report to PATH (the image keeps its build's verdicts there)")
    parser.add_argument("--exit-zero", action="store_true",
                        help="exit 0 whatever the verdict (a report; the verdict line still says its status)")
    parser.add_argument("--verbose", action="store_true",
                        help="every adapter's full reasons: each proof, site and caller, and its engine check's")
    parser.add_argument(
        "--engine", metavar="PATH",
        help="check an engine that is not imported here: an sglang wheel, or a folder holding sglang/ "
             "(an unpacked wheel or site-packages); read from its sources, nothing of it runs")


class SelectionError(ValueError):
    """doctor ADAPTER naming no adapter: bad configuration, EXIT_FLAGS."""


def doctor_selection(opts) -> tuple[list[str], list[str]]:
    """(the adapters named before --, in the pack's order; the command after it). The words
    before -- may hold options too (`doctor folded_fence --json`): they are read as doctor's."""
    words = opts.command
    cut = words.index("--") if "--" in words else len(words)
    if words[cut:] == ["--"]:
        build_parser().error("no COMMAND after --")
    names = Parser(prog="sglang-adapters doctor", **DOCTOR_HELP)
    doctor_options(names)
    names.add_argument("adapters", nargs="*")
    asked = names.parse_intermixed_args(words[:cut], namespace=opts).adapters
    by_name = {key: name for name in ADAPTERS for key in (name, *load(name).flags)}
    unknown = [word for word in asked if word not in by_name]
    if unknown:
        near = difflib.get_close_matches(unknown[0], by_name, n=1)
        raise SelectionError(f"doctor {unknown[0]}: no adapter of this pack has that name or flag"
                             + (f"; did you mean {near[0]}?" if near else "")
                             + f" (its adapters: {', '.join(ADAPTERS)}; a command to judge goes after --)")
    chosen = {by_name[word] for word in asked}
    return [name for name in ADAPTERS if name in chosen], words[cut + 1:]


def doctor(opts) -> int:
    try:
        selected, command = doctor_selection(opts)
    except SelectionError as exc:
        runtime.emit(f"{exc} (exit {EXIT_FLAGS})")
        return EXIT_FLAGS
    if command:
        deployment, judged = topology.from_command(command)
        if deployment is None:
            print(f"{runtime.PREFIX} doctor -- {' '.join(command)}: {judged} (exit {EXIT_USAGE})", file=sys.stderr, flush=True)
            return EXIT_USAGE
    else:
        deployment, judged = None, ""
    try:
        wanted = required.parse(opts.require)
    except required.RequireError as exc:
        runtime.emit(f"doctor {exc} (exit {EXIT_FLAGS})")
        return EXIT_FLAGS
    with tempfile.TemporaryDirectory() as workdir:
        if opts.engine:
            try:
                engine = open_engine(opts.engine, workdir)
                engine.version  # noqa: B018  a tree without a readable version is bad input too
            except (ValueError, OSError) as exc:
                runtime.emit(f"doctor --engine {opts.engine}: {exc} (exit {EXIT_USAGE})")
                return EXIT_USAGE
        else:
            engine = InstalledEngine()
        try:
            found = report(os.environ, engine, deployment, judged, wanted, strict=opts.strict)
        except required.RequireError as exc:
            runtime.emit(f"doctor {exc} (exit {EXIT_FLAGS})")
            return EXIT_FLAGS
    status = VERDICT_STATUS[verdict(found)]
    shown = only(found, selected) if selected else found  # the verdict stays the whole pack's
    if opts.record:
        try:
            with open(opts.record, "w", encoding="utf-8") as handle:
                json.dump(as_json(found, opts.engine, status), handle, indent=2)
        except OSError as exc:
            runtime.emit(f"doctor --record {opts.record}: cannot be written ({exc.strerror or exc}) (exit {EXIT_USAGE})")
            return EXIT_USAGE
    if opts.json:
        emit(json.dumps(as_json(shown, opts.engine, status), indent=2))
    else:
        if not found["ranks_checked"]:
            ranks = (f"run_scheduler_process calls the plugin loader; which plugins it finds is not checked: the engine at "
                     f"{opts.engine} is read from its sources and its loader is not the one installed here")
        elif found["delivery_problems"] and not found["enabled"]:
            ranks = "; ".join(found["delivery_problems"]) + " (every adapter is off: nothing is lost, the launch goes on)"
        else:
            ranks = None
        full = opts.verbose or bool(selected)
        emit("\n".join(verdict_lines(found, status, opts.exit_zero, bool(selected))) + "\n\n"
             + render_table(found["engine"], shown["adapters"], found["delivery_problems"], ranks, found["unknown_flags"],
                            provenance=found["provenance"], entry_point=found["entry_point"], verbose=full)
             + render_deployment(shown, verbose=full))
    return EXIT_OK if opts.exit_zero else status


def verdict_lines(found: dict, status: int, exit_zero: bool, narrowed: bool) -> list[str]:
    """doctor's first lines: the verdict and its exit status, then each reason for it (a flag
    error, a refused flag that is set or required, ranks that cannot load the pack), one line each."""
    exits = f"exit 0 with --exit-zero; the verdict's status is {status}" if exit_zero else f"exit {status}"
    lines = [f"verdict: {verdict(found)} ({exits})" + ("; of every adapter, not only those shown" if narrowed else "")]
    lines += [f"  flag error: {error}" for error in found["flag_errors"]]
    lines += [f"  refused: {r['adapter']} {r['flag']}={r['value']!r}: {r['short_reason']}"
              for r in found["adapters"] if r["state"] == runtime.REFUSED]
    lines += [f"  required and refused: {r['adapter']} {r['flag']}"
              + ("" if r["value"] is None else f"={r['value']!r}") + f" ({r['source']}): {r['short_reason']}"
              for r in found["required"] if r["outcome"] == runtime.REFUSED]
    if found["failed"]:  # what stops the start beyond the adapters' own refusals (conflicts, ranks that skip the pack)
        lines += [f"  problem: {problem}" for problem in found["problems"]]
    if found["installation_broken"]:
        lines += [f"  ranks cannot load the pack: {problem}" for problem in found["delivery_problems"]] or [
            "  ranks cannot load the pack"]
    return lines


def only(found: dict, names: list[str]) -> dict:
    """The report's adapters (and their outcomes per layout) narrowed to `names`."""
    return {**found, "adapters": [r for r in found["adapters"] if r["adapter"] in names],
            "by_layout": {name: per_layout for name, per_layout in found["by_layout"].items() if name in names}}


def emit(text: str) -> None:
    """The report on stdout; a reader that leaves early (`doctor | head`) is no error of the
    pack: the rest goes nowhere and the exit status stays the verdict's."""
    try:
        print(text, flush=True)
    except BrokenPipeError:
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())


def report(environ, engine, deployment=None, judged: str = "", wanted=(), strict: bool = True) -> dict:
    """doctor's findings: the decision the launcher and every rank take for `environ` on
    `engine` and the `deployment` (a Topology, None: every topology), plus each adapter's
    engine check (switched on, every other adapter off), which the image's build records.
    Without a deployment,
    `by_layout` holds the outcomes on each representative layout wherever they differ.
    `failed` is what doctor fails on: a flag that is set refused, a required flag (`wanted`,
    framework.required) refused and, with `strict`, an installation whose ranks cannot load the
    pack; `flag_errors` the pack's flags not understood. Every other engine check is printed and
    recorded, never failed on: an upgrade the pack cannot fully judge still builds."""
    # said at once: doctor imports the engine, seconds in which an import may hold the interpreter
    with progress.step(f"doctor: judging {len(ADAPTERS)} adapters and the ranks' plugin loading on the engine at "
                       f"{engine.origin or 'this interpreter'}", first=0):
        return _report(environ, engine, deployment, judged, wanted, strict)


def _report(environ, engine, deployment, judged: str, wanted, strict: bool) -> dict:
    decision = runtime.decide(environ, engine, topology=deployment)
    rows = []
    for outcome in decision.outcomes:
        adapter = load(outcome.adapter)
        check = runtime.engine_verdict(adapter, engine)  # the engine alone: any deployment
        rows.append({**outcome.as_dict(), "summary": adapter.summary, "engine_check": check[0], "engine_check_reason": check[1],
                     "engine_check_short_reason": check[2], "setting": decision.settings.get(outcome.adapter),
                     "machine": runtime.machine_note(outcome.adapter) or None})
    checks = {r["adapter"]: (r["engine_check"], r["engine_check_reason"], r["engine_check_short_reason"]) for r in rows}
    needed = required.judge(list(wanted), engine, checks, deployment)
    broken = strict and isinstance(engine, InstalledEngine) and delivery.installation_broken()
    delivery_problems = runtime.delivery_problems(environ, engine)
    plugins = delivery.discovery_module(engine)
    return {
        "engine": decision.engine, "provenance": engine_provenance(engine), "adapters": rows, "enabled": decision.enabled,
        "problems": decision.problems, "delivery_problems": delivery_problems,
        # A release read from source: its ranks' plugin discovery is judged with the installed
        # loader where that is the same code (adapter.framework.delivery), else it is not checked.
        "ranks_checked": isinstance(engine, InstalledEngine) or bool(delivery_problems) or plugins is not None,
        "entry_point": delivery.pack_entry_point(environ, plugins) if plugins is not None else None,
        "unknown_flags": runtime.unknown_flags(environ) + runtime.ignored_note(environ),
        "ignored_variables": runtime.service_links(environ),
        "flag_errors": decision.flag_errors, "switched_off": decision.switched_off,
        # An installation whose ranks cannot load the pack fails the build even with every flag off.
        "failed": decision.refused or broken or any(r["outcome"] == runtime.REFUSED for r in needed),
        "required": needed, "installation_broken": broken,
        "deployment": deployment, "judged": judged,
        "by_layout": {} if deployment is not None else by_layout(environ, engine),
    }


def by_layout(environ, engine) -> dict:
    """adapter -> {layout name: (outcome, reason, short reason)} on each representative layout, for the
    adapters whose outcome differs between them (the decision without a deployment holds
    for every layout)."""
    outcomes = {name: runtime.decide(environ, engine, topology=layout).outcomes
                for name, layout in topology.REPRESENTATIVE.items()}
    found = {}
    for index, adapter in enumerate(ADAPTERS):
        per_layout = {name: (o[index].state, o[index].reason, o[index].short_reason) for name, o in outcomes.items()}
        if len({state for state, *_ in per_layout.values()}) > 1:
            found[adapter] = per_layout
    return found


def render_deployment(found: dict, verbose: bool = True) -> str:
    """Which deployment the verdicts are for: the command's, or every layout, then the
    adapters whose outcome depends on the layout, one line per layout (its full reason, or
    with `verbose` False the short one)."""
    if found["deployment"] is not None:
        return f"\ndeployment: {found['deployment'].describe()} ({found['judged']})"
    lines = ["", "deployment: none given (doctor -- COMMAND judges one); the outcomes above hold for every layout"]
    for adapter, per_layout in found["by_layout"].items():
        lines.append(f"  {adapter} depends on the layout:")
        for name, (state, reason, short) in per_layout.items():
            line = f"{topology.REPRESENTATIVE[name].describe()}: {state} - {reason if verbose else short}"
            lines.append(wrapped(line, "    ") if verbose else runtime.clip("    " + line, runtime.DOCTOR_LINE_LIMIT))
    return "\n".join(lines)


def engine_provenance(engine) -> dict:
    """Where the engine came from and where its version label was read (under what the
    user named: the installed folder, a folder, a wheel). Verdicts never read the label."""
    label, origin = engine.label, engine.origin
    if label.source is None or origin is None:
        source = None
    else:
        source = str(origin / label.source) if origin.is_dir() else f"{label.source} in {origin}"
    location = origin / "sglang" if isinstance(engine, InstalledEngine) and origin is not None else origin
    return {"location": str(location), "version_source": source, "released": label.released, "judged_by": "code"}


def engine_header(version: str, provenance: dict) -> list[str]:
    """doctor's first lines: the engine's label, and that it is only a label."""
    unreleased = "" if provenance["released"] else f": {UNRELEASED}"
    source = provenance["version_source"]
    label = f"label {version} from {source}" if source else f"label {version}, found in no file of the engine"
    return [f"sglang {version}{unreleased}",
            f"engine at {provenance['location']}; {label}; verdicts are judged by the engine's code, not by its label"]


def verdict(found: dict) -> str:
    return "flag-error" if found["flag_errors"] else "refused" if found["failed"] else "ok"


def _setting(value):
    """A parsed setting as JSON: a switch as a boolean, a site selection as its labels, a
    setting with fields (tp_divergence's) as an object."""
    if value is None or isinstance(value, bool):
        return value
    if dataclasses.is_dataclass(value):
        return dataclasses.asdict(value)
    return sorted((getattr(item, "label", str(item)) for item in value), key=lambda label: int(label.split(":")[0]))


def as_json(found: dict, source: str | None, status: int) -> dict:
    """`doctor --json`, schema version SCHEMA_VERSION (docs/doctor-report.schema.json)."""
    if source:
        engine = {"version": found["engine"], "source": "path", "path": source}
    else:
        spec = importlib.util.find_spec("sglang")
        engine = {"version": found["engine"], "source": "installed",
                  "path": os.path.dirname(spec.origin) if spec and spec.origin else None}
    engine.update({k: found["provenance"][k] for k in ("version_source", "released", "judged_by")})
    entry = found["entry_point"]
    return {
        "schema_version": SCHEMA_VERSION,
        "pack": {"name": DIST, "version": pack_version()},
        "engine": engine,
        "verdict": verdict(found),
        "strict_exit_status": status,
        "exit_status": status,
        "required": found["required"],
        "installation_broken": found["installation_broken"],
        "switched_off": found["switched_off"],
        "adapters": [{
            "adapter": r["adapter"], "flag": r["flag"], "value": r["value"], "setting": _setting(r["setting"]),
            "outcome": r["state"], "reason": r["reason"], "short_reason": r["short_reason"], "summary": r["summary"],
            "engine_check": {"outcome": r["engine_check"], "reason": r["engine_check_reason"],
                             "short_reason": r["engine_check_short_reason"]},
            "machine": r["machine"],
        } for r in found["adapters"]],
        "ranks": {"checked": found["ranks_checked"], "problems": found["delivery_problems"],
                  "entry_point": entry and {"name": entry.name, "value": entry.value, "distribution": entry.dist}},
        "flag_errors": found["flag_errors"],
        "problems": found["problems"],
        "deployment": None if found["deployment"] is None else {
            **dataclasses.asdict(found["deployment"]), "attn_tp_size": found["deployment"].attn_tp_size,
            "judged_from": found["judged"]},
        "by_layout": {adapter: {name: {"topology": dataclasses.asdict(topology.REPRESENTATIVE[name]), "outcome": state,
                                       "reason": reason, "short_reason": short}
                                for name, (state, reason, short) in per_layout.items()}
                      for adapter, per_layout in found["by_layout"].items()},
        "ignored_variables": found["ignored_variables"],
    }


def render_table(version: str, rows: list[dict], delivery: list[str], ranks: str | None = None,
                 unknown: list[str] = (), *, provenance: dict | None = None, entry_point=None, verbose: bool = True) -> str:
    header = ("adapter", "flag", "value", "outcome", "engine check")
    table = [header] + [
        (r["adapter"], r["flag"], "<unset>" if r["value"] is None else repr(r["value"]), r["state"], r["engine_check"])
        for r in rows
    ]
    widths = [max(len(row[i]) for row in table) for i in range(len(header))]
    lines = [*(engine_header(version, provenance) if provenance else [f"sglang {version}"]), ""]
    lines += ["  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in table]
    lines.append("")
    lines += full_reasons(rows) if verbose else [*map(summary_line, rows), DETAILS]
    lines.append("")
    if ranks is None:
        ranks = "; ".join(delivery) if delivery else (
            "every TP rank loads the pack through the engine's plugin loader" + (f": {entry_point}" if entry_point else ""))
    lines.append("ranks: " + ranks)
    for problem in unknown:
        lines.append("flags: " + problem)
    return "\n".join(lines)


DETAILS = "(every proof, site and caller behind these lines: doctor --verbose, or doctor ADAPTER ...)"


def summary_line(row: dict) -> str:
    """One adapter in one line: its outcome and the deciding reason; where its engine check
    refuses (what --strict fails on) and the outcome does not, that refusal instead."""
    if row["engine_check"] == runtime.REFUSED and row["state"] != runtime.REFUSED:
        line = f"{row['adapter']}: {row['state']}; engine check refused - {row['engine_check_short_reason']}"
    else:
        line = f"{row['adapter']}: {row['state']} - {row['short_reason']}"
    return runtime.clip(line, runtime.DOCTOR_LINE_LIMIT)


WRAP = 100  # --verbose's paragraphs: a reason runs to 2,000 characters


def wrapped(text: str, indent: str = "  ") -> str:
    """`text` wrapped to WRAP columns, its continuation lines indented under its first word."""
    return textwrap.fill(text, WRAP, initial_indent=indent, subsequent_indent=indent + "  ", break_long_words=False,
                         break_on_hyphens=False)


def full_reasons(rows: list[dict]) -> list[str]:
    """Each adapter's paragraph: what it does, its outcome's and its engine check's full reasons."""
    lines = []
    for r in rows:
        lines.append(wrapped(f"{r['adapter']}: {r['summary']}", ""))
        lines.append(wrapped(f"outcome: {r['reason']}"))
        if r["engine_check_reason"] != r["reason"]:
            lines.append(wrapped(f"engine check: {r['engine_check_reason']}"))
        if r.get("machine"):
            lines.append(wrapped(f"this machine: {r['machine']}"))
    return lines


# --- canary ---------------------------------------------------------------------------------

def run_canary(opts) -> int:
    from .rollout import canary

    problem = canary.nothing_to_judge(opts)
    if problem:
        opts.usage_error(problem)  # the canary's own usage, exit EXIT_USAGE
    return canary.run(opts)


# --- launch and the wrapper -------------------------------------------------------------------

def check_and_apply(command: list[str]) -> int:
    """Decide and apply in this process (one line per adapter on stderr, and the refusal's)
    for the deployment `command` starts (its server arguments, read with the engine's own
    parser; every layout when they cannot be read); the exit status that stops the launch,
    or EXIT_OK."""
    with progress.step(f"checking the flags and the engine before running {command[0] if command else 'the server'}"):
        deployment, judged = topology.from_command(command)
        decision = runtime.apply_once(os.environ, deployment, judged)
    if decision.error() is None:
        return EXIT_OK
    return EXIT_FLAGS if decision.flag_errors else EXIT_REFUSED


def launch(argv: list[str]) -> int:
    status = check_and_apply(argv)
    if status:
        return status
    sys.argv = [SERVER_MODULE, *argv]
    runpy.run_module(SERVER_MODULE, run_name="__main__", alter_sys=True)  # its SystemExit passes through
    return EXIT_OK


def wrap(command: list[str]) -> int:
    """Like ddtrace-run: check and apply here, then become COMMAND (exec: same pid, its own
    signals and exit status). What the adapters hand to the engine's switches is in the
    environment it inherits; every TP rank it starts applies the adapters through the
    engine's plugin loader."""
    status = check_and_apply(command)
    if status:
        return status
    other = other_engine(command)
    if other:
        runtime.emit(other)
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a stream that cannot be written loses its lines; COMMAND still runs
            pass
    try:
        os.execvp(command[0], command)
    except FileNotFoundError:
        runtime.emit(f"{command[0]}: command not found")
        return EXIT_NOT_FOUND
    except OSError as exc:
        runtime.emit(f"{command[0]}: cannot run: {exc.strerror}")
        return EXIT_CANNOT_RUN


def interpreter(command: list[str]) -> str | None:
    """The Python that COMMAND runs: itself (python3 ...) or its script's #! line (sglang serve ...)."""
    path = shutil.which(command[0]) if command else None
    if path is None:
        return None
    if PYTHON.fullmatch(os.path.basename(path)):
        return path
    try:
        with open(path, "rb") as script:
            first = script.readline(256)
    except OSError:
        return None
    words = first[2:].decode(errors="replace").split() if first.startswith(b"#!") else []
    if words and os.path.basename(words[0]) == "env" and len(words) > 1:
        words = [shutil.which(words[1]) or words[1]]
    return words[0] if words and PYTHON.fullmatch(os.path.basename(words[0])) else None


PYTHON = re.compile(r"python[0-9.]*")
_WHERE = "import importlib.util as u; s = u.find_spec('sglang'); print(s.submodule_search_locations[0] if s else '')"


def other_engine(command: list[str]) -> str:
    """A warning where COMMAND's Python imports another sglang than the one just judged (a venv's
    checks, then a system python3 without the engine), else ""."""
    python = interpreter(command)
    if python is None:
        return ""
    try:
        found = subprocess.run([python, "-c", _WHERE], capture_output=True, text=True, timeout=60).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return ""
    judged = installed_package()
    if judged is not None and found and os.path.realpath(found) == os.path.realpath(judged):
        return ""
    theirs = f"the sglang at {found}" if found else "no sglang"
    return (f"warning: {command[0]} runs {python}, which imports {theirs}; the checks above judged the sglang at "
            f"{judged} ({sys.executable}): run COMMAND with {sys.executable}, or install the pack beside that "
            "Python's engine and run its sglang-adapters")


if __name__ == "__main__":
    sys.exit(main())
