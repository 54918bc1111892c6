"""The engine's watchdog dump gains the divergence report's state (DSV41_TP_DIVERGENCE on).

In every release 0.5.16 - 0.5.23 the scheduler's watchdog is a `WatchdogRaw` built by
`create_scheduler_watchdog` (managers/scheduler_components/invariant_checker.py) with a
`dump_info` callable; on a timeout the watchdog thread logs `dump_info()`, runs py-spy and
SIGQUITs the launcher (utils/watchdog.py). `Watchdog.create` (used elsewhere, and by its
stuck tester, `test_stuck_time`) builds a `WatchdogRaw` with none. `WatchdogRaw.__init__` is
wrapped so that its dump_info, the engine's or none, is followed by `divergence.dump()`: the
last landed read of the counters, no device call (the GPU may be wedged when it runs).
"""

from __future__ import annotations

import functools
import inspect

from ..engine.contract import POSITIONAL, Contract, source_proof, target_modules
from ..framework.plan import Patch
from . import divergence

MODULE = "sglang.srt.utils.watchdog"
SCHEDULER_WATCHDOG = "sglang.srt.managers.scheduler_components.invariant_checker"
NAME = "tp_divergence"


def dump_after(engine_dump) -> str:
    """The engine's dump (its exception, if any, left as it was), then the report's state."""
    parts = [engine_dump() if engine_dump is not None else "", divergence.dump()]
    return "\n".join(part for part in parts if part)


def with_report_dump(wrapped, instance, args, kwargs):
    """Around WatchdogRaw.__init__: its dump_info followed by the report's state."""
    bound = inspect.signature(wrapped).bind(*args, **kwargs)
    bound.arguments["dump_info"] = functools.partial(dump_after, bound.arguments.get("dump_info"))
    return wrapped(*bound.args, **bound.kwargs)


@source_proof("watchdog-dump-built")
def _built_with_dump_info(scheduler: Contract) -> tuple:
    """The lines where the module calls WatchdogRaw(..., dump_info=...)."""
    return tuple(call.line for call in scheduler.calls("WatchdogRaw", method=False)
                 if any(k.arg == "dump_info" for k in call.node.keywords))


def patch(engine) -> tuple[Patch, str]:
    """The patch on WatchdogRaw.__init__ and what the reason line says of it; refused where
    the watchdog no longer takes dump_info or the scheduler's no longer passes one."""
    modules = target_modules(NAME, engine, ((MODULE, True), (SCHEDULER_WATCHDOG, True)))
    contract = Contract(NAME, modules[MODULE])
    contract.params("WatchdogRaw.__init__", {"dump_info": POSITIONAL})
    scheduler = Contract(NAME, modules[SCHEDULER_WATCHDOG])
    built = _built_with_dump_info(scheduler)
    if not built:
        raise scheduler.refuse("create_scheduler_watchdog", "no longer builds WatchdogRaw(..., dump_info=...): the "
                                                            "scheduler's watchdog dump would not show the report")
    detail = (f"the scheduler's watchdog dump ({SCHEDULER_WATCHDOG}.create_scheduler_watchdog, line "
              f"{built[0]}) ends with the report's last landed state, at {MODULE}.WatchdogRaw.__init__")
    return Patch(contract.attr("WatchdogRaw"), "__init__", with_report_dump), detail
