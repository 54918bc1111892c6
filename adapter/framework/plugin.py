"""The pack's entry in the engine's plugin loader (group `sglang.srt.plugins`).

The engine spawns each TP rank as a fresh interpreter and calls its plugin loader
first thing there, so this is how every rank gets the same adapters. The loader
also runs in the launcher, DP controller and detokenizer: here it only registers a
hook, importing nothing heavy. The adapters are applied at the start of
`Scheduler.__init__`, i.e. in every rank and before any worker is built or graph
captured; a refusal raised there goes down the engine's own start-up failure path
(the rank signals the launcher, which kills the process tree), because the plugin
loader itself logs and swallows exceptions.
"""

from __future__ import annotations

import os

import wrapt

from .. import ADAPTERS, load
from . import patching, runtime, topology
from .plan import Patch

SCHEDULER_MODULE = "sglang.srt.managers.scheduler"
GUARD = "pack-guard"


def register() -> None:
    wrapt.register_post_import_hook(_guard_scheduler, SCHEDULER_MODULE)


def _apply_before_init(wrapped, instance, args, kwargs):
    # Scheduler(server_args, ...) in every release: the rank judges its own deployment.
    runtime.label_scheduler(wrapped, args, kwargs)  # its lines and metrics say which rank it is
    server_args = args[0] if args else kwargs.get("server_args")
    if server_args is not None:
        deployment, judged = topology.from_server_args(server_args), "this rank's server_args"
    else:
        deployment, judged = None, "no server_args reached the Scheduler: every layout"
    error = runtime.apply_once(os.environ, deployment, judged).error()
    if error is not None:
        raise error
    return wrapped(*args, **kwargs)


def _guard_scheduler(module) -> None:
    scheduler = getattr(module, "Scheduler", None)
    if scheduler is not None and "__init__" in vars(scheduler):
        patching.apply(Patch(scheduler, "__init__", _apply_before_init), GUARD)
        return
    message = runtime.log.render(
        f"{SCHEDULER_MODULE}.Scheduler.__init__ is gone: the pack cannot apply "
        "its adapters inside the ranks"
    )
    if any(load(name).flag in os.environ for name in ADAPTERS) and not runtime.switched_off(os.environ):
        # The loader swallows Exception; SystemExit ends this process, so the rank dies.
        raise SystemExit(message)
    runtime.log.emit(message.removeprefix(runtime.log.head()))
