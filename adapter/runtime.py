"""Deciding and applying every adapter in one process, and reporting what happened.

Used by the entrypoint (launcher, doctor) and by the plugin inside each TP rank, so
that every process takes its decision the same way and prints the same lines.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import os
import sys
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import Optional

from . import ADAPTERS, load
from .contract import Refused, engine_version, installed
from .flags import FlagError

PREFIX = "[sglang-adapters]"
PLUGIN_GROUP = "sglang.srt.plugins"
PLUGIN_TARGET = "adapter.plugin:register"

OFF, APPLIED, SUPERSEDED, REFUSED = "off", "applied", "superseded", "refused"


class AdapterRefused(Exception):
    """Raised where it stops the engine: an ordinary Exception, so that inside a rank the
    engine's own start-up failure path (SIGQUIT to the launcher, tree kill) takes over."""


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


class InstalledEngine:
    """The engine this interpreter imports: modules are imported for real."""

    @property
    def version(self) -> str:
        return engine_version()

    def module(self, name: str):
        """The module, or None when this release does not have it."""
        return importlib.import_module(name) if installed(name) else None


def engine_check(adapter, *, patch: bool, engine=None, as_if_on: bool = False) -> tuple[str, str]:
    """Check (and with `patch`, install) the adapter in every module it targets.

    `as_if_on` checks the adapter as if its flag held CHECK_VALUE (its broadest setting),
    whatever the environment says: doctor's engine check and the compatibility matrix.

    `engine` gives the modules: the installed one by default, or a source tree read
    without importing it (adapter.source_engine.SourceEngine). Returns (state, reason).
    A module-level "not needed" never makes the adapter applied on its own: something
    must be patched or already fixed upstream.
    """
    engine = engine or InstalledEngine()
    if as_if_on:
        adapter.parse({adapter.FLAG: adapter.CHECK_VALUE})
    plans = []
    try:
        for module_name, required in adapter.TARGETS:
            try:
                module = engine.module(module_name)
            except Exception as exc:  # a module that no longer loads cannot be checked
                raise Refused(adapter.NAME, module_name, f"import failed: {type(exc).__name__}: {exc}", engine.version) from exc
            if module is None:
                if required:
                    raise Refused(adapter.NAME, module_name, "module is missing from this engine", engine.version)
                continue
            try:
                plans.append((adapter.install if patch else adapter.check)(module))
            except Refused:
                raise
            except Exception as exc:  # a check that cannot run is no pass: fail closed, say why
                raise Refused(adapter.NAME, module_name, f"check failed: {type(exc).__name__}: {exc}", engine.version) from exc
    except Refused as exc:
        return REFUSED, str(exc)
    done = [p for p in plans if p.state in (APPLIED, SUPERSEDED)]
    if not done:
        return REFUSED, f"{adapter.NAME} found nothing to patch and no upstream fix on sglang {engine.version}"
    state = APPLIED if any(p.state == APPLIED for p in done) else SUPERSEDED
    return state, "; ".join(p.detail for p in done)


def decide(adapter, environ: Mapping[str, str], *, patch: bool = True, engine=None) -> Outcome:
    """The adapter's outcome in this process: off, applied, superseded or refused."""
    engine = engine or InstalledEngine()
    value = environ.get(adapter.FLAG)
    try:
        enabled = adapter.parse(environ)
    except FlagError as exc:
        state, reason = REFUSED, str(exc)
    else:
        if not enabled:
            state, reason = OFF, f"{adapter.FLAG} is off"
        else:
            state, reason = engine_check(adapter, patch=patch, engine=engine)
    return Outcome(adapter.NAME, adapter.FLAG, value, state, reason, engine.version)


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
    known = {load(name).FLAG for name in ADAPTERS}
    return [
        f"{key} is not a flag of this pack (its flags: {', '.join(sorted(known))})"
        for key in sorted(environ) if key.startswith("DSV41_") and key not in known
    ]


_applied: Optional[list[Outcome]] = None


def apply_all(environ: Mapping[str, str] = os.environ) -> list[Outcome]:
    """Decide and apply every adapter once per process; print one line per adapter."""
    global _applied
    if _applied is None:
        _applied = [decide(load(name), environ) for name in ADAPTERS]
        for outcome in _applied:
            print(outcome.line(), file=sys.stderr, flush=True)
    return _applied


def refusal(outcomes: list[Outcome], extra: list[str] = ()) -> Optional[AdapterRefused]:
    reasons = [o.reason for o in outcomes if o.state == REFUSED] + list(extra)
    if not reasons:
        return None
    return AdapterRefused("the engine must not start: " + " | ".join(reasons))
