"""What an adapter is: one declared object (`Surface`), checked when the adapter loads.

Each adapter folder's `__init__.py` ends with `SURFACE = Surface(...)`; the runtime, doctor,
the tools and the JSON report read nothing else of it. What it reads of the other adapters
is declared too (`reads`), and the runtime hands it exactly that: their settings, or what
they hand to the engine's switches, never a lookup by name it did not declare. So are the
engine's server arguments its verdict reads (`server_args`): the deployment is read for them
(framework.topology), so that a new adapter adds no field to the framework.
"""

from __future__ import annotations

import inspect
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Optional

from .ledger import Ledger

SETTING, HANDOVER = "setting", "handover"  # what an adapter may read of another
FLAG_NAME = re.compile(r"DSV41_[A-Z0-9_]+")
SERVER_ARG = re.compile(r"[a-z][a-z0-9_]*")  # a ServerArgs field, as the engine names it
COMMAND_NAME = re.compile(r"[a-z][a-z0-9]*(-[a-z0-9]+)*")


class SurfaceError(TypeError):
    """An adapter that does not declare what the pack needs of it: a defect of the pack, raised
    when it loads (and by the tests), never at a user."""


@dataclass(frozen=True)
class Surface:
    """name: the adapter's folder; flag: its switch; summary: one line for help and doctor;
    parse(environ) -> setting (falsy: off; FlagError: not understood); check(engine,
    setting, context) -> Plan (Refused: drift); check_value: the flag's broadest value,
    for the engine check and the compatibility matrix; reads: other adapter -> what of it
    this one reads (SETTING, HANDOVER or both, comma-separated); check_with: other adapters
    switched on for the engine check (name -> flag value); extra_flags: further variables
    it reads -> their help line; machine(): what this machine adds to an applied outcome;
    commands: subcommands of the pack's command line it brings (`sglang-adapters NAME ARGS...`
    -> run(ARGS) -> exit status; the first line of run's docstring is its help); server_args:
    the engine's server arguments (ServerArgs field names) its verdict reads, handed as
    context.topology.server_args; ledger: why it exists and when it retires."""

    name: str
    flag: str
    summary: str
    parse: Callable
    check: Callable
    check_value: str
    ledger: Ledger
    reads: Mapping[str, str] = field(default_factory=dict)
    check_with: Mapping[str, str] = field(default_factory=dict)
    extra_flags: Mapping[str, str] = field(default_factory=dict)
    machine: Optional[Callable[[], str]] = None
    commands: Mapping[str, Callable[[list[str]], int]] = field(default_factory=dict)
    server_args: tuple[str, ...] = ()

    @property
    def flags(self) -> tuple[str, ...]:
        return (self.flag, *self.extra_flags)

    def reads_kind(self, kind: str) -> tuple[str, ...]:
        return tuple(name for name, what in self.reads.items() if kind in what.split(","))


def _takes(function: Callable, count: int) -> bool:
    """`function` can be called with `count` positional arguments."""
    try:
        inspect.signature(function).bind(*range(count))
    except (TypeError, ValueError):
        return False
    return True


def validate(surface, name: str, registered: tuple[str, ...]) -> Surface:
    """`surface` as the adapter `name` declared it, or SurfaceError naming what is wrong."""
    def wrong(problem: str) -> SurfaceError:
        return SurfaceError(f"adapter {name}: {problem}")

    if not isinstance(surface, Surface):
        raise wrong(f"its SURFACE is {type(surface).__name__}, not a Surface")
    if surface.name != name:
        raise wrong(f"its SURFACE is named {surface.name!r}, its folder {name!r}")
    for flag in surface.flags:
        if not FLAG_NAME.fullmatch(flag):
            raise wrong(f"flag {flag!r} is not DSV41_ and capitals")
    if not surface.summary.strip():
        raise wrong("its summary is empty")
    if not callable(surface.parse) or not _takes(surface.parse, 1):
        raise wrong("parse does not take (environ)")
    if not callable(surface.check) or not _takes(surface.check, 3):
        raise wrong("check does not take (engine, setting, context)")
    if not surface.parse({surface.flag: surface.check_value}):
        raise wrong(f"check_value {surface.check_value!r} does not switch {surface.flag} on")
    for other, what in surface.reads.items():
        if other == name or other not in registered:
            raise wrong(f"reads {other!r}, which is not another registered adapter")
        if not set(what.split(",")) <= {SETTING, HANDOVER}:
            raise wrong(f"reads {what!r} of {other}: only {SETTING!r} and {HANDOVER!r} can be read")
    if not set(surface.check_with) <= set(surface.reads_kind(SETTING)):
        raise wrong("check_with names an adapter whose setting it does not declare it reads")
    if isinstance(surface.server_args, str) or not all(
            isinstance(arg, str) and SERVER_ARG.fullmatch(arg) for arg in surface.server_args):
        raise wrong(f"server_args {surface.server_args!r} is not a tuple of server argument names (snake_case)")
    if surface.machine is not None and not callable(surface.machine):
        raise wrong("machine is not callable")
    for command, run in surface.commands.items():
        if not COMMAND_NAME.fullmatch(command):
            raise wrong(f"command {command!r} is not lower-case words joined by hyphens")
        if not callable(run) or not _takes(run, 1) or not (run.__doc__ or "").strip():
            raise wrong(f"command {command!r} does not take (argv) with a docstring for its help")
    if not isinstance(surface.ledger, Ledger):
        raise wrong("it has no Ledger")
    return surface
