"""The one decision and the one actor.

Adapters only declare (framework.surface): `parse(environ)` gives a setting,
`check(engine, setting, context)` gives a plan for the engine it is handed (installed, or
read from a release's sources). `decide` runs them all the same way for doctor, doctor --engine,
the launcher and every TP rank; `apply` carries a decision out (patches and the
variables handed to the engine) through `patching`, which records every change.

An adapter knows of the others exactly what its surface declares it reads: their settings,
or what they hand to the engine's switches (`Context.handed`, never through os.environ);
the order is fixed by those hand-overs, not by the order of ADAPTERS.
"""

from __future__ import annotations

import difflib
import enum
import os
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field, replace
from typing import Optional

from .. import ADAPTERS, load
from ..engine.contract import Refused, Undecided
from ..engine import proofs, settings
from ..engine.syntax import collector_paused
from ..engine.installed import EngineImportError, InstalledEngine
from ..engine.source_engine import UNRELEASED, released
from . import audit, delivery, log, metrics, oneline, patching
from .flags import SWITCH_OFF, FlagError, resembles, service_link
from .ledger import RETIRED_FLAGS
from .log import LOG_FORMAT, LOG_FORMATS, PREFIX, emit, label_scheduler, log_format, set_process_label  # noqa: F401
from .plan import Plan
from .surface import HANDOVER, SETTING, Surface
from .topology import Topology


class State(enum.StrEnum):
    """An adapter's outcome in one process."""

    OFF = "off"
    APPLIED = "applied"
    SUPERSEDED = "superseded"
    REFUSED = "refused"
    # doctor --engine on sources only: what the verdict rests on runs only where the engine
    # is imported; each rank decides it at launch (never a pass, never a refusal)
    AT_LAUNCH = "decided at launch"


OFF, APPLIED, SUPERSEDED, REFUSED, AT_LAUNCH = State

# The pack's own switches besides the adapters' flags. DSV41_ADAPTERS=off (or 0, false,
# none, any case, as every flag): nothing is decided or applied anywhere (the rollback);
# DSV41_ADAPTERS_LOG=json: the pack's lines as JSON for log pipelines (adapter.framework.log). Any
# other value of either is a start-up error.
MASTER = "DSV41_ADAPTERS"
MASTER_OFF = "off"
LINE_LIMIT = 199  # a per-process line stays under 200 characters; details are doctor's
DOCTOR_LINE_LIMIT = 160  # doctor's one line per adapter, `adapter: outcome - short reason`; details: doctor ADAPTER
_VALUE_LIMIT = 32
_MORE = " ... (details: sglang-adapters doctor)"


class AdapterRefused(Exception):
    """Raised where it stops the engine: an ordinary Exception, so that inside a rank the
    engine's own start-up failure path (SIGQUIT to the launcher, tree kill) takes over."""


class Declared(dict):
    """What one adapter declared it reads of the others (its surface's `reads`): asking for
    any other is a defect of the pack, raised, never answered with a silent default."""

    def __init__(self, adapter: str, values: Mapping):
        super().__init__(values)
        self.adapter = adapter

    def __missing__(self, key):
        raise LookupError(f"{self.adapter} reads {key!r}, which its surface does not declare")

    def get(self, key, default=None):
        return self[key]


@dataclass(frozen=True)
class Context:
    """What an adapter's check may know besides the engine: the process environment (the
    engine's own switches as the user set them), the settings of the adapters it declares
    it reads (None where a flag was refused) and their flags, what the adapters whose
    hand-over it declares it reads hand to the engine, and the deployment's topology
    (framework.topology), None where it is not known: a verdict that depends on it must
    then hold for every topology."""

    environ: Mapping[str, str] = field(default_factory=dict)
    settings: Mapping[str, object] = field(default_factory=dict)
    handed: Mapping[str, str] = field(default_factory=dict)
    topology: Optional[Topology] = None
    flags: Mapping[str, str] = field(default_factory=dict)

    def engine_env(self, name: str) -> Optional[str]:
        """The variable as the engine's processes will read it."""
        return self.handed.get(name, self.environ.get(name))


@dataclass(frozen=True)
class Outcome:
    adapter: str
    flag: str
    value: Optional[str]  # the raw environment value, None when unset
    state: str
    reason: str
    engine: str
    short_reason: str = ""  # the deciding reason, so that summary_line() fits DOCTOR_LINE_LIMIT

    def summary_line(self) -> str:
        """doctor's line for this outcome: what happens and the deciding reason."""
        return f"{self.adapter}: {self.state} - {self.short_reason}"

    def entry(self, machine: str = "") -> tuple[str, dict]:
        """This outcome as a line of the pack (adapter.framework.log): its message, shortened so that the
        text line stays under 200 characters, and its fields for the JSON form (the whole
        reason). `machine`: what this machine adds to an applied adapter (the fence's copy), first."""
        # The adapter and release are on the line already: not twice.
        reason = self.reason.removeprefix(f"{self.adapter} refused on sglang {self.engine}: ")
        message = _message(f"{self.adapter} {self.flag}", self.value, self.state,
                           f"{machine}; {reason}" if machine else reason, self.engine)
        return message, dict(adapter=self.adapter, flag=self.flag, value=self.value, outcome=self.state,
                             reason=self.reason, engine=self.engine, **({"machine": machine} if machine else {}))

    def line(self, form: str = "text", machine: str = "") -> str:
        message, fields = self.entry(machine)
        return log.render(message, form, **fields)

    def as_dict(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class Decision:
    """Every adapter's outcome for one environment and one engine, and the plans behind
    them; `problems` are start-up errors outside any adapter (a misspelt flag)."""

    engine: str
    outcomes: tuple[Outcome, ...]
    plans: Mapping[str, Plan]
    problems: tuple[str, ...] = ()
    # The subset of the refusal reasons that are errors in the pack's own flags (a value
    # or a name not understood), as opposed to a drifted engine or a conflict.
    flag_errors: tuple[str, ...] = ()
    settings: Mapping[str, object] = field(default_factory=dict)
    switched_off: bool = False  # DSV41_ADAPTERS=off
    topology: Optional[Topology] = None  # the deployment judged for; None: every topology
    judged: str = ""  # where the deployment was read (a rank's server_args, a command), or why it is not known

    def entries(self) -> list[tuple[str, dict]]:
        """What a process that took this decision prints (message and fields, adapter.framework.log):
        one line per adapter, or one line in all when the whole pack is switched off."""
        if self.switched_off:
            reason = "the whole pack is off: no adapter is decided or applied in this process"
            return [(_message(MASTER, MASTER_OFF, OFF, reason, self.engine),
                     dict(flag=MASTER, value=MASTER_OFF, outcome=OFF, reason=reason, engine=self.engine))]
        head = [self.deployment_entry()] if self.judged else []
        return head + [o.entry(machine_note(o.adapter) if o.state == APPLIED else "") for o in self.outcomes]

    def deployment_entry(self) -> tuple[str, dict]:
        """Which deployment this process judged, and where it was read from."""
        described = self.topology.describe() if self.topology is not None else "every layout"
        return f"deployment: {described} ({self.judged})", dict(deployment=described, judged_from=self.judged,
                                                               engine=self.engine)

    def lines(self, form: str = "text") -> list[str]:
        return [log.render(message, form, **fields) for message, fields in self.entries()]

    @property
    def reasons(self) -> list[str]:
        return [o.reason for o in self.outcomes if o.state == REFUSED] + list(self.problems)

    @property
    def refused(self) -> bool:
        return bool(self.reasons)

    @property
    def enabled(self) -> bool:
        return any(o.state != OFF for o in self.outcomes)

    def error(self) -> Optional[AdapterRefused]:
        if not self.refused:
            return None
        return AdapterRefused("the engine must not start: " + " | ".join(self.reasons))


def machine_note(name: str) -> str:
    """What this machine adds to an adapter's outcome, if the adapter says (`machine`):
    not part of the decision, which depends on the flags and the engine only."""
    machine = load(name).machine
    return machine() if machine is not None else ""


def order(names=ADAPTERS) -> list[str]:
    """Adapters in decision order: each after those whose hand-over it declares it reads,
    otherwise by name, so that the order of ADAPTERS never matters."""
    pending, done = sorted(names), []
    while pending:
        ready = [n for n in pending if all(dep in done or dep not in pending for dep in load(n).reads_kind(HANDOVER))]
        if not ready:
            raise RuntimeError(f"adapters read each other's hand-overs in a cycle: {pending}")
        done.append(ready[0])
        pending.remove(ready[0])
    return done


def _check(adapter: Surface, engine, setting, context: Context) -> tuple[str, str, str, Optional[Plan]]:
    """(state, reason, short reason, plan) of one adapter's check."""
    try:
        if isinstance(engine, InstalledEngine):
            engine.require()  # an engine that cannot be imported stops the pack whole, not one adapter
        with collector_paused():
            plan = adapter.check(engine, setting, context)
        if not plan.short_reason:
            raise ValueError(f"its {plan.state} plan gives no short reason")  # a defect of the pack, said
    except EngineImportError:
        raise
    except (Refused, Undecided) as exc:
        state = REFUSED if isinstance(exc, Refused) else AT_LAUNCH
        return state, str(exc), f"sglang {exc.version}: {_short_symbol(exc.symbol)}: {exc.problem}", None
    except Exception as exc:  # a check that cannot run is no pass: fail closed, say why
        failed = f"check failed: {type(exc).__name__}: {exc}"
        return REFUSED, f"{adapter.name} refused on sglang {engine.version}: {failed}", f"sglang {engine.version}: {failed}", None
    finally:
        for note in proofs.notes():  # the proof cache's own problems: a folder it cannot use, an entry ignored
            emit(note)
    return State(plan.state), plan.detail, plan.short_reason, plan


def _short_symbol(symbol: str) -> str:
    """`package.module:Class.attr` as `module:Class.attr`, a module as its own name: the one
    line keeps the symbol, not its package (a flag has no dot and stays as it is)."""
    module, colon, attr = symbol.partition(":")
    return module.rpartition(".")[2] + colon + attr


def clip(text: str, limit: int) -> str:
    """`text` in at most `limit` characters, its end cut at a word where it does not fit."""
    return oneline.cut(text, limit)


def _outcome(name: str, flag: str, value, state: str, reason: str, short: str, engine: str) -> Outcome:
    """An outcome whose short reason fits doctor's line: its fix whole, the rest cut (oneline.fit)."""
    room = DOCTOR_LINE_LIMIT - len(Outcome(name, flag, value, state, reason, engine).summary_line())
    return Outcome(name, flag, value, state, reason, engine, oneline.fit(short, room))


def context_for(adapter: Surface, environ, settings: Mapping, handed: Mapping[str, dict],
                topology: Optional[Topology]) -> Context:
    """The context `adapter` is checked with: of the other adapters, exactly what it declares
    it reads (`handed`: adapter -> the variables it hands to the engine), and of the
    deployment's server arguments those it declares."""
    reads = {name: load(name) for name in adapter.reads}
    if topology is not None and topology.server_args is not None:  # of the deployment's arguments, its own
        topology = replace(topology, server_args=Declared(adapter.name, {
            name: topology.server_args[name] for name in adapter.server_args}))
    return Context(environ, Declared(adapter.name, {n: settings.get(n) for n in adapter.reads_kind(SETTING)}),
                   {var: value for n in adapter.reads_kind(HANDOVER) for var, value in handed.get(n, {}).items()},
                   topology, {n: surface.flag for n, surface in reads.items()})


def decide(environ: Mapping[str, str], engine=None, names=ADAPTERS, topology: Optional[Topology] = None,
           judged: str = "") -> Decision:
    """Every adapter's outcome for `environ` on `engine` (the installed one by default), for
    the deployment `topology` (None: not known, judged for every topology; `judged`: where it
    was read, for the process's lines). Pure: nothing is patched and nothing is written into
    the environment."""
    engine = engine or InstalledEngine()
    adapters = {name: load(name) for name in names}
    if switched_off(environ):
        reason = f"{MASTER}=off: the whole pack is off"
        outcomes = tuple(_outcome(n, a.flag, environ.get(a.flag), OFF, reason, reason, engine.version)
                         for n, a in adapters.items())
        return Decision(engine.version, outcomes, {}, switched_off=True, topology=topology, judged=judged)
    settings, flag_errors = _parse(adapters, environ)
    outcomes, plans, handed = {}, {}, {}
    for name in order(names):
        adapter = adapters[name]
        if name in flag_errors:
            state, reason, short, plan = REFUSED, flag_errors[name], flag_errors[name], None
        elif not settings[name]:
            reason = f"{adapter.flag} is off"
            state, short, plan = OFF, reason, None
        else:
            context = context_for(adapter, environ, settings, handed, topology)
            state, reason, short, plan = _check(adapter, engine, settings[name], context)
        if plan is not None:
            plans[name] = plan
            handed[name] = dict(plan.env)
        outcomes[name] = _outcome(name, adapter.flag, environ.get(adapter.flag), state, reason, short, engine.version)
    flag_problems = tuple(unknown_flags(environ) + switch_problems(environ))
    enabled = any(o.state != OFF for o in outcomes.values())
    # ranks that skip the plugin would not apply it
    problems = flag_problems + (tuple(delivery_problems(environ, engine)) if enabled else ())
    return Decision(engine.version, tuple(outcomes[n] for n in names), plans, problems,
                    flag_errors=tuple(flag_errors.values()) + flag_problems, settings=settings, topology=topology,
                    judged=judged)


def _parse(adapters: Mapping[str, Surface], environ: Mapping[str, str]) -> tuple[dict, dict]:
    """Each adapter's setting (None where its flag is not understood), and its flag's error."""
    settings, errors = {}, {}
    for name, adapter in adapters.items():
        try:
            settings[name] = adapter.parse(environ)
        except FlagError as exc:
            settings[name], errors[name] = None, str(exc)
    return settings, errors


def flag_errors(environ: Mapping[str, str]) -> list[str]:
    """The pack's flags not understood in `environ`, as decide() finds them (Decision.flag_errors),
    without judging any engine: what --help checks."""
    if switched_off(environ):
        return []
    _, errors = _parse({name: load(name) for name in ADAPTERS}, environ)
    return list(errors.values()) + unknown_flags(environ) + switch_problems(environ)


def engine_check(adapter: Surface, engine=None, topology: Optional[Topology] = None) -> tuple[str, str]:
    """engine_verdict's state and reason."""
    return engine_verdict(adapter, engine, topology)[:2]


def engine_verdict(adapter: Surface, engine=None, topology: Optional[Topology] = None) -> tuple[str, str, str]:
    """(state, reason, short reason): what `adapter` would do on `engine` if switched on at its broadest setting
    (check_value), with every other adapter off (but those named in its check_with) and no
    engine switch set: a judgement of the engine alone (doctor's engine check column, the
    compatibility matrix), for `topology` (None: every topology)."""
    engine = engine or InstalledEngine()
    # One engine object is one engine: its verdict alone is judged once per adapter and layout
    # (doctor's column on every report a caller makes with it, the agreement of many flag sets).
    judged = engine.__dict__.setdefault("_engine_verdicts", {})
    if (adapter.name, topology) not in judged:
        judged[adapter.name, topology] = _engine_verdict(adapter, engine, topology)
    return judged[adapter.name, topology]


def _engine_verdict(adapter: Surface, engine, topology: Optional[Topology]) -> tuple[str, str, str]:
    setting = adapter.parse({adapter.flag: adapter.check_value})
    # An adapter that works on another's changes (check_with) is judged with those on.
    settings = {name: load(name).parse({load(name).flag: value}) for name, value in adapter.check_with.items()}
    # no engine switch set; the adapter's own flag as it is judged (a hand-over reads its words)
    context = context_for(adapter, {adapter.flag: adapter.check_value}, settings, {}, topology)
    state, reason, short, _ = _check(adapter, engine, setting, context)
    return state, reason, _outcome(adapter.name, adapter.flag, None, state, reason, short, engine.version).short_reason


def apply(decision: Decision) -> None:
    """Make this process match `decision`: every planned patch and hand-over in place,
    and whatever an earlier decision applied that this one does not plan, reverted."""
    if decision.refused:
        raise decision.error()
    wanted = {(patching.key(p.owner, p.name)): (name, p) for name, plan in decision.plans.items() for p in plan.patches}
    for saved in patching.applied():
        if saved.adapter in ADAPTERS and patching.key(saved.owner, saved.name) not in wanted:
            patching.revert(saved.owner, saved.name)
    for name, patch in wanted.values():
        patching.apply(patch, name)
    env = {var: (name, value) for name, plan in decision.plans.items() for var, value in plan.env.items()}
    for var, adapter in patching.applied_env().items():
        if var not in env:
            patching.revert_env(var)
    for var, (name, value) in env.items():
        patching.set_env(var, value, name)


def revert() -> None:
    """Undo every change the adapters made in this process (tests)."""
    apply(Decision("", (), {}))


_applied: Optional[Decision] = None


def judged_here(decision: Decision) -> Decision:
    """A rank's decision: "decided at launch" means this launch, so an outcome the rank still
    cannot decide (what reached its Scheduler does not say enough) is refused: a rank never
    starts unjudged."""
    late = " this rank could not decide it from what reached its Scheduler either, and a rank does not start unjudged"
    outcomes = tuple(replace(o, state=REFUSED, reason=f"{o.reason};{late}", short_reason=f"{o.short_reason};{late}")
                     if o.state == AT_LAUNCH else o for o in decision.outcomes)
    return replace(decision, outcomes=outcomes)


def apply_once(environ: Mapping[str, str] = os.environ, topology: Optional[Topology] = None,
               judged: str = "", rank: bool = False) -> Decision:
    """Decide and apply once per process (launcher, each rank) for the deployment's
    `topology` (each rank's from its server_args); one line per adapter.
    A refused decision is printed and returned unapplied: the caller stops the engine.
    Once applied, a loaded engine module that still holds an original the pack wrapped
    refuses it too (adapter.framework.audit)."""
    global _applied
    if _applied is None:
        with collector_paused():
            decision = decide(environ, topology=topology, judged=judged)
            if rank:
                decision = judged_here(decision)
            if not decision.refused:
                apply(decision)
                decision = replace(decision, problems=decision.problems + tuple(audit.problems(patching.applied(),
                                                                                              decision.engine)))
        _applied = decision
        form = log_format(environ)
        for note in ignored_note(environ):
            emit(note, form, ignored=service_links(environ))
        for message, fields in _applied.entries():
            emit(message, form, **fields)
        if _applied.refused:
            emit(str(_applied.error()), form, fatal=True)
        metrics.outcomes(_applied, environ)
    return _applied


def reset() -> None:
    """Forget this process's decision (tests): the next apply_once decides again."""
    global _applied
    _applied = None


def switched_off(environ: Mapping[str, str]) -> bool:
    """DSV41_ADAPTERS holds an off value: 0/off/false/none/no/n in any case, as every flag."""
    return environ.get(MASTER, "").lower() in SWITCH_OFF


def switch_problems(environ: Mapping[str, str]) -> list[str]:
    """Start-up errors in the pack's own switches: strict values, as for every flag."""
    problems = []
    if MASTER in environ and not switched_off(environ):
        problems.append(f"{MASTER}={environ[MASTER]!r} is not understood: set it to {'/'.join(SWITCH_OFF)} (any case) "
                        f"to switch the whole pack off in the launcher and every rank, or leave it unset")
    if LOG_FORMAT in environ and environ[LOG_FORMAT].lower() not in LOG_FORMATS:
        problems.append(f"{LOG_FORMAT}={environ[LOG_FORMAT]!r} is not understood: 'json' for one JSON object "
                        f"per line, 'text' or unset for plain lines (any case)")
    return problems


def _message(subject: str, value, state: str, reason: str, engine: str) -> str:
    """`<subject>='value': STATE - reason (sglang X)` (subject: the adapter and its flag, or
    the master switch), the value and then the reason shortened so that the text line
    (`[sglang-adapters] pid=N rank=R ` first) stays under LINE_LIMIT characters."""
    if value is None:
        shown = "<unset>"
    else:
        shown = repr(value if len(value) <= _VALUE_LIMIT else value[:_VALUE_LIMIT - 3] + "...")
    head = f"{subject}={shown}: {state.upper()} - "
    tail = f" (sglang {engine})" if released(engine) else f" (sglang {engine}: {UNRELEASED})"
    room = LINE_LIMIT - len(log.head()) - len(head) - len(tail)
    if len(reason) > room:
        reason = oneline.fit(reason, max(room - len(_MORE), 0)) + _MORE
    return head + reason + tail


def delivery_problems(environ: Mapping[str, str], engine=None) -> list[str]:
    """Why spawned ranks would not run the pack's plugin, if they would not: the engine's
    scheduler process must call its plugin loader (read from source, any engine), and the
    engine's own discovery must choose the pack under `environ` (where it can run here:
    adapter.framework.delivery.discovery_module)."""
    engine = engine or InstalledEngine()
    problems = delivery.loader_problems(engine)
    plugins = delivery.discovery_module(engine)
    if plugins is not None:
        problems += delivery.discovery_problems(environ, plugins)
    return problems


def pack_flags() -> set[str]:
    """Every variable the pack reads as a flag: the adapters' and its own switches."""
    return {flag for name in ADAPTERS for flag in load(name).flags} | {MASTER, LOG_FORMAT, *settings.NAMES}


def unknown_flags(environ: Mapping[str, str]) -> list[str]:
    """DSV41_* variables the pack does not read, and any variable whose name is a near miss
    of a flag (another case, or within two edits: dsv41_folded_fence, DSV4_FOLDED_FENCE): a
    typo would otherwise leave the intended adapter off without a word. Kubernetes' service
    links (DSV41_PORT=tcp://10.0.0.1:30000 for a Service `dsv41`) are left out: service_links."""
    known = pack_flags() | RETIRED_FLAGS.keys()  # a retired flag is said, not refused (ignored_note)
    hint = lambda near: f"; did you mean {near}?" if near else ""  # noqa: E731
    return [f"{key} is not a flag of this pack{hint(near)} (its flags: {', '.join(sorted(known))})"
            for key, near in _not_flags(environ, known) if not service_link(key, environ[key])]


def service_links(environ: Mapping[str, str]) -> list[str]:
    """The variables unknown_flags would refuse but leaves out, because their names and
    values are those Kubernetes gives a pod for a Service of the namespace."""
    return [key for key, _ in _not_flags(environ, pack_flags() | RETIRED_FLAGS.keys()) if service_link(key, environ[key])]


def ignored_note(environ: Mapping[str, str]) -> list[str]:
    """What the launcher, each rank and doctor say once of the variables they ignore: the
    Kubernetes service links, and the flags of adapters retired from the pack
    (framework.ledger.RETIRED_FLAGS), which an env file may still set; and the old names of the
    pack's settings still set (engine.settings)."""
    ignored = service_links(environ)
    notes = [f"ignored {', '.join(ignored)}: Kubernetes service links, not flags of this pack "
             "(enableServiceLinks: false in the pod spec leaves them out)"] if ignored else []
    return notes + [f"ignored {flag}={environ[flag]!r}: {RETIRED_FLAGS[flag]}" for flag in sorted(RETIRED_FLAGS)
                    if flag in environ] + settings.alias_notes(environ)


def _not_flags(environ: Mapping[str, str], known: set[str]):
    """(name, the flag it resembles or None) for every variable the pack would take for a
    flag it does not have."""
    for key in sorted(environ):
        if key in known:
            continue
        near = resembles(key, known)
        if near is None and key.startswith("DSV41_"):
            near = next(iter(difflib.get_close_matches(key, known, n=1)), None)
        elif near is None:
            continue
        yield key, near
