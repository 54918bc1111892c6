"""The pack's entry in the engine's plugin loader (group `sglang.srt.plugins`).

The engine spawns each TP rank as a fresh interpreter and calls its plugin loader
first thing there, so this is how every rank gets the same adapters. The loader
also runs in the launcher, DP controller and detokenizer: here it only registers a
hook, importing nothing heavy. The adapters are applied at the start of
`Scheduler.__init__`, i.e. in every rank and before any worker is built or graph
captured; a refusal raised there goes down the engine's own start-up failure path
(the rank signals the launcher, which kills the process tree), because the plugin
loader itself logs and swallows exceptions.

Where the release has the engine's HookRegistry (0.5.16-0.5.23 all do) and the scheduler
module is imported already (a rank: the loader runs inside run_scheduler_process; the
launcher), the guard is registered there as an AROUND hook, so that the engine's own log
lists it ("Applied 1 hook(s) to ...Scheduler.__init__ (from: plugin=dsv41_adapters, ...)");
it raises from inside Scheduler(...) as before. Elsewhere (a detokenizer or DP controller
that never imports the scheduler) registering it would make the engine import the scheduler
there, so a post-import hook stays. Why the decode-path bindings do not go through it:
docs/adapters.md, "Bindings and the engine's HookRegistry".
"""

from __future__ import annotations

import os
import sys

import wrapt

from .. import ADAPTERS, load
from . import patching, runtime, topology
from .plan import Patch

SCHEDULER_MODULE = "sglang.srt.managers.scheduler"
GUARD = "pack-guard"


HOOK_TARGET = f"{SCHEDULER_MODULE}.Scheduler.__init__"
_registered = False


def register() -> None:
    global _registered
    module = sys.modules.get(SCHEDULER_MODULE)
    registry = _hook_registry() if module is not None else None
    if registry is None or not _has_init(module):
        wrapt.register_post_import_hook(_guard_scheduler, SCHEDULER_MODULE)
    elif not _registered:  # the loader runs once per process; a second register() adds no second hook
        registry.HookRegistry.register(HOOK_TARGET, _around_init, registry.HookType.AROUND)
        _registered = True


def guarded() -> bool:
    """Whether this process's Scheduler.__init__ runs the pack's guard: through the engine's
    HookRegistry, or the pack's own binding."""
    if any(saved.adapter == GUARD for saved in patching.applied()):
        return True
    registry = _hook_registry() if _registered else None
    return registry is not None and HOOK_TARGET in registry.HookRegistry._patched


def _hook_registry():
    """The engine's sglang.srt.plugins.hook_registry, or None where the release has none."""
    try:
        from sglang.srt.plugins import hook_registry
    except ImportError:
        return None
    return hook_registry if hasattr(hook_registry, "HookRegistry") else None


def _has_init(module) -> bool:
    scheduler = getattr(module, "Scheduler", None)
    return scheduler is not None and "__init__" in vars(scheduler)


def _around_init(original, scheduler, *args, **kwargs):
    """The guard as the engine's AROUND hook: original(scheduler, ...) once the rank has applied."""
    return _apply_before_init(original.__get__(scheduler, type(scheduler)), scheduler, args, kwargs)


def _apply_before_init(wrapped, instance, args, kwargs):
    # Scheduler(server_args, ...) in every release: the rank judges its own deployment.
    runtime.label_scheduler(wrapped, args, kwargs)  # its lines and metrics say which rank it is
    server_args = args[0] if args else kwargs.get("server_args")
    if server_args is not None:
        deployment, judged = topology.from_server_args(server_args), "this rank's server_args"
    else:
        deployment, judged = None, "no server_args reached the Scheduler: every layout"
    error = runtime.apply_once(os.environ, deployment, judged, rank=True).error()
    if error is not None:
        raise error
    return wrapped(*args, **kwargs)


def _guard_scheduler(module) -> None:
    scheduler = getattr(module, "Scheduler", None)
    if _has_init(module):
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
