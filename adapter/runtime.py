"""The one decision and the one actor.

Adapters only declare: `parse(environ)` gives a setting, `check(engine, setting,
context)` gives a plan for the engine it is handed (installed, or read from a
release's sources). `decide` runs them all the same way for doctor, doctor --engine,
the launcher and every TP rank; `apply` carries a decision out (patches and the
variables handed to the engine) through `patching`, which records every change.

What one adapter hands to the engine reaches the adapters decided after it as an
explicit input (`Context.handed`), never through os.environ, and the order is fixed
by what each adapter declares it reads (`AFTER`), not by the order of ADAPTERS.
"""

from __future__ import annotations

import importlib.metadata
import os
import sys
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from typing import Optional

from . import ADAPTERS, load, patching
from .contract import InstalledEngine, Plan, Refused
from .flags import FlagError

PREFIX = "[sglang-adapters]"
PLUGIN_GROUP = "sglang.srt.plugins"
PLUGIN_TARGET = "adapter.plugin:register"

OFF, APPLIED, SUPERSEDED, REFUSED = "off", "applied", "superseded", "refused"


class AdapterRefused(Exception):
    """Raised where it stops the engine: an ordinary Exception, so that inside a rank the
    engine's own start-up failure path (SIGQUIT to the launcher, tree kill) takes over."""


@dataclass(frozen=True)
class Context:
    """What an adapter's check may know besides the engine: the process environment (the
    engine's own switches as the user set them), every adapter's setting (None where its
    flag was refused), and what the adapters decided before it hand to the engine."""

    environ: Mapping[str, str] = field(default_factory=dict)
    settings: Mapping[str, object] = field(default_factory=dict)
    handed: Mapping[str, str] = field(default_factory=dict)

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

    def line(self) -> str:
        value = "<unset>" if self.value is None else repr(self.value)
        return (
            f"{PREFIX} pid={os.getpid()} {self.adapter} {self.flag}={value}: "
            f"{self.state.upper()} - {self.reason} (sglang {self.engine})"
        )

    def as_dict(self) -> dict:
        return asdict(self)


@dataclass
class Decision:
    """Every adapter's outcome for one environment and one engine, and the plans behind
    them; `problems` are start-up errors outside any adapter (a misspelt flag)."""

    engine: str
    outcomes: list[Outcome]
    plans: dict[str, Plan]
    problems: list[str] = field(default_factory=list)

    @property
    def reasons(self) -> list[str]:
        return [o.reason for o in self.outcomes if o.state == REFUSED] + self.problems

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


def order(names=ADAPTERS) -> list[str]:
    """Adapters in decision order: each after those whose hand-over it reads (AFTER),
    otherwise by name, so that the order of ADAPTERS never matters."""
    pending, done = sorted(names), []
    while pending:
        ready = [n for n in pending if all(dep in done or dep not in pending for dep in getattr(load(n), "AFTER", ()))]
        if not ready:
            raise RuntimeError(f"adapters read each other's hand-overs in a cycle: {pending}")
        done.append(ready[0])
        pending.remove(ready[0])
    return done


def _check(adapter, engine, setting, context: Context) -> tuple[str, str, Optional[Plan]]:
    try:
        plan = adapter.check(engine, setting, context)
    except Refused as exc:
        return REFUSED, str(exc), None
    except Exception as exc:  # a check that cannot run is no pass: fail closed, say why
        return REFUSED, f"{adapter.NAME} refused on sglang {engine.version}: check failed: {type(exc).__name__}: {exc}", None
    return plan.state, plan.detail, plan


def decide(environ: Mapping[str, str], engine=None, names=ADAPTERS) -> Decision:
    """Every adapter's outcome for `environ` on `engine` (the installed one by default).
    Pure: nothing is patched and nothing is written into the environment."""
    engine = engine or InstalledEngine()
    adapters = {name: load(name) for name in names}
    settings, flag_errors = {}, {}
    for name, adapter in adapters.items():
        try:
            settings[name] = adapter.parse(environ)
        except FlagError as exc:
            settings[name], flag_errors[name] = None, str(exc)
    outcomes, plans, handed = {}, {}, {}
    for name in order(names):
        adapter = adapters[name]
        if name in flag_errors:
            state, reason, plan = REFUSED, flag_errors[name], None
        elif not settings[name]:
            state, reason, plan = OFF, f"{adapter.FLAG} is off", None
        else:
            context = Context(environ, settings, dict(handed))
            state, reason, plan = _check(adapter, engine, settings[name], context)
        if plan is not None:
            plans[name] = plan
            handed.update(plan.env)
        outcomes[name] = Outcome(name, adapter.FLAG, environ.get(adapter.FLAG), state, reason, engine.version)
    decision = Decision(engine.version, [outcomes[n] for n in names], plans, unknown_flags(environ))
    if isinstance(engine, InstalledEngine) and decision.enabled:
        decision.problems += delivery_problems(environ)  # ranks that skip the plugin would not apply it
    return decision


def engine_check(adapter, engine=None) -> tuple[str, str]:
    """What `adapter` would do on `engine` if switched on at its broadest setting
    (CHECK_VALUE), with every other adapter off (but those named in its CHECK_WITH) and no
    engine switch set: a judgement of the engine alone (doctor's engine check column, the
    compatibility matrix)."""
    engine = engine or InstalledEngine()
    setting = adapter.parse({adapter.FLAG: adapter.CHECK_VALUE})
    settings = {adapter.NAME: setting}
    # An adapter that works on another's changes (CHECK_WITH) is judged with those on.
    for name, value in getattr(adapter, "CHECK_WITH", {}).items():
        settings[name] = load(name).parse({load(name).FLAG: value})
    state, reason, _ = _check(adapter, engine, setting, Context(settings=settings))
    return state, reason


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
    apply(Decision("", [], {}))


_applied: Optional[Decision] = None


def apply_once(environ: Mapping[str, str] = os.environ) -> Decision:
    """Decide and apply once per process (launcher, each rank); one line per adapter.
    A refused decision is printed and returned unapplied: the caller stops the engine."""
    global _applied
    if _applied is None:
        _applied = decide(environ)
        if not _applied.refused:
            apply(_applied)
        for outcome in _applied.outcomes:
            print(outcome.line(), file=sys.stderr, flush=True)
    return _applied


def delivery_problems(environ: Mapping[str, str]) -> list[str]:
    """Why spawned ranks would not run the pack's plugin, if they would not."""
    ours = [ep for ep in importlib.metadata.entry_points(group=PLUGIN_GROUP) if ep.value == PLUGIN_TARGET]
    if not ours:
        return [
            f"the pack's plugin ({PLUGIN_TARGET}) is not registered in entry-point group "
            f"{PLUGIN_GROUP}: install the pack with pip so that every TP rank loads it"
        ]
    allowed = environ.get("SGLANG_PLUGINS", "")
    names = {x.strip() for x in allowed.split(",") if x.strip()}
    if names and ours[0].name not in names:
        return [f"SGLANG_PLUGINS={allowed!r} does not list the pack's plugin '{ours[0].name}', so ranks would skip it"]
    return []


def unknown_flags(environ: Mapping[str, str]) -> list[str]:
    """DSV41_* variables no adapter reads: a typo (DSV41_FOLDED_FENSE=1) would otherwise
    leave the intended adapter off without a word."""
    known = {flag for name in ADAPTERS for flag in (load(name).FLAG, *getattr(load(name), "EXTRA_FLAGS", ()))}
    return [
        f"{key} is not a flag of this pack (its flags: {', '.join(sorted(known))})"
        for key in sorted(environ) if key.startswith("DSV41_") and key not in known
    ]
