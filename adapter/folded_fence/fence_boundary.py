"""The fence's run-time guarantee, where a verify step's results leave the worker.

The fence's drift checks read the engine's sources: an early warning, not a proof.
`DSparkWorkerV2.forward_batch_generation` is where a step's results leave the worker
for the scheduler, whose overlapped readback may run after the next verify replay
rewrote the epilogue's persistent buffers. There, every tensor the result holds is
compared by storage with every tensor the epilogue holds, whatever the result's shape:
its fields and those of the objects, lists, tuples, dicts, slotted objects and msgspec
structs it holds, down to MAX_DEPTH levels. One that shares storage is copied there, on
the forward stream and before the next replay is queued, so the readback still reads
this step; and the route is named once per process, since the fence's checks missed it.
A holder that cannot take the copy in place (a tuple, a frozen struct) is rebuilt and
handed to its own holder; the result itself, rebuilt, is what the worker returns.

The check never breaks a step: a shape it cannot walk, a holder it cannot rebuild, a
walk cut by its bounds (MAX_DEPTH, MAX_VALUES) is reported once, never raised.

Two walks, one verdict. The Python walk (`_walk`) copies, reports and learns new types
(holders.KINDS). Where the fence's kernel library is loaded (a GPU the prebuilt file
serves), its native scan looks first: one call that answers "clean" only where the
Python walk would find no route and report nothing (the same kinds, layouts, bounds and
skips), and "unsure" for anything it does not read exactly as the walk does (a type not
met yet, a tensor subclass, a list, tuple or dict subclass that reads otherwise, a
getattr that raises, a changed epilogue); the Python walk then runs as before. Once a scan
is bound, the wrapper itself runs in C too (`boundary_check`): a clean step runs no Python
of the pack's, and what is copied and said is the walk's alone.
Which check serves is said once, at the first check on a GPU; on the CPU the Python walk
serves and nothing is said.

Cost: one look at each value the result holds and one storage lookup per tensor, every
step (figures in the README's performance section).
"""

from __future__ import annotations

import torch

from . import accept_snapshot, holders
from ..framework import log, metrics

MAX_DEPTH = 4      # the result's own fields are level 1: a view two objects down is level 3
MAX_VALUES = 256   # tensors and holders looked at per step, at most (a DSpark decode result: about 15)

_said: set = set()     # what was already reported in this process
_storages: dict = {}   # id(epilogue) -> (watched names, ids of their values, attribute count, storage map, native scan or None)
_KINDS, _kind = holders.KINDS, holders.kind
_LEAF, _TENSOR, _SEQUENCE, _MAPPING = holders.LEAF, holders.TENSOR, holders.SEQUENCE, holders.MAPPING
_PROBE = object()      # not known yet: found at the first check on a GPU
_native = _PROBE       # the kernel library whose native scan serves, None: the Python walk alone
_native_check = None   # check_results in C, once a scan is bound (the library serves)
EPILOGUE = "_verify_epilogue"  # the worker's attribute that holds the verify graph's epilogue


def reset() -> None:
    """Forget the routes already reported and the epilogues' storage maps (tests)."""
    _said.clear()
    _storages.clear()


def use_native(library=_PROBE) -> None:
    """Which check serves (tests, benchmarks): `library`'s native scan (a loaded kernel
    library), None for the Python walk alone, or by default what the first check on a GPU finds."""
    global _native, _native_check
    _native, _native_check = library, None
    _storages.clear()


def check_mode() -> str:
    """"native" where the native scan serves the clean steps, else "python"."""
    return "python" if _library() is None else "native"


def _library():
    """The loaded kernel library, or None. Found at the first check made while CUDA is up
    (the rank's own device is current then): the copy's mode is probed, if the fence's
    first CUDA result has not done it, and both are said once."""
    global _native
    if _native is _PROBE and torch.cuda.is_initialized():
        _native = accept_snapshot.probed_extension()
        say_once("check", f"boundary check: native scan ({_native.__file__})" if _native is not None else
                          f"boundary check: the Python walk (no kernel library: {accept_snapshot.copy_mode()[1]})")
    return None if _native is _PROBE else _native


def check_results(wrapped, instance, args, kwargs):
    """The wrapper on the worker's return. Once the native scan serves, its C form
    (`boundary_check` in the kernel file) does all of this and hands `_checked` only what
    the scan is unsure of: a clean step runs no Python here."""
    if _native_check is not None:
        return _native_check(wrapped, instance, args, kwargs)
    result = wrapped(*args, **kwargs)
    epilogue = getattr(instance, EPILOGUE, None)
    if epilogue is None or result is None or result is epilogue:
        return result
    return _checked(result, epilogue)


def _checked(result, epilogue):
    try:
        scan = (_storages.get(id(epilogue)) or _cache(epilogue))[4]  # detach_escapes' first look, inline
        if scan is not None and scan(result, epilogue):
            return result
        return _walk(result, epilogue)[0]
    except Exception as exc:  # noqa: BLE001 - never break a step; said once
        say_once(("failed", type(result)), f"boundary: could not check a {type(result).__name__} leaving the worker "
                                           f"({type(exc).__name__}: {exc}); its tensors were not compared with the verify graph's buffers")
        return result


def persistent_storages(epilogue) -> dict:
    """Storage address -> attribute name, for every tensor the epilogue holds. Rebuilt when
    an attribute is added, or one that held a tensor or None is rebound (a buffer allocated
    late, or replaced); its other attributes (per-step state) are not watched."""
    return _cache(epilogue)[3]


def _cache(epilogue) -> tuple:
    state = vars(epilogue)
    cached = _storages.get(id(epilogue))
    if (cached is None or cached[2] != len(state) or cached[1] != tuple(map(id, map(state.get, cached[0])))
            or (cached[4] is None and _native is _PROBE and torch.cuda.is_initialized())):  # built before CUDA was up
        watched = tuple(name for name, value in state.items() if value is None or isinstance(value, torch.Tensor))
        ids = tuple(map(id, map(state.get, watched)))
        storages = {t.untyped_storage().data_ptr(): name for name, t in state.items()
                    if isinstance(t, torch.Tensor) and t.numel()}
        library = _library()
        scan = None if library is None else library.boundary_scan(  # bound once: the same test of this map's freshness
            holders.KINDS, holders._layouts, (holders.LEAF, holders.TENSOR, holders.SEQUENCE, holders.MAPPING, holders.HOLDER),
            (torch.Tensor, torch.nn.Parameter), watched, list(ids), len(state), list(storages), MAX_DEPTH, MAX_VALUES)
        cached = _storages[id(epilogue)] = (watched, ids, len(state), storages, scan)
        if scan is not None:
            _serve_native(library)
    return cached


def _serve_native(library) -> None:
    global _native_check
    if _native_check is None:  # reads this very map (never rebound: reset() clears it in place)
        _native_check = library.boundary_check(_storages, _checked, EPILOGUE)


def detach_escapes(result, epilogue) -> tuple[object, list[str]]:
    """(`result` with every tensor that shares storage with the epilogue's buffers copied,
    the routes found as "Holder.field <- Epilogue.buffer"). The result is the same object
    unless it had to be rebuilt (a tuple, a frozen struct). The native scan first, where
    it serves: clean means the Python walk would find and say nothing."""
    scan = (_storages.get(id(epilogue)) or _cache(epilogue))[4]
    if scan is not None and scan(result, epilogue):
        return result, []
    return _walk(result, epilogue)


def _walk(result, epilogue) -> tuple[object, list[str]]:
    """detach_escapes in Python. Breadth first, so that a long list deep down cannot use up
    the budget before the result's own fields are looked at: `queue` holds (holder, level,
    index of its own holder in the queue, its key there); routes are spelled out only when
    said; the copies are put back deepest first."""
    storages, name = persistent_storages(epilogue), type(epilogue).__name__
    queue, changes, routes, left, at = [(result, 1, -1, None)], {}, [], MAX_VALUES, 0
    while at < len(queue) and left >= 0:
        holder, level, _, _ = queue[at]
        try:
            for key, value in holders.items(holder):
                if value is None:
                    continue
                what = _KINDS.get(type(value)) or _kind(type(value))
                if what is _LEAF or value is epilogue:
                    continue
                left -= 1
                if left < 0:
                    where = _where(queue, at)
                    say_once(("cut", where), f"boundary: stopped at {where} after {MAX_VALUES} values; "
                                             "what lies beyond was not compared with the verify graph's buffers")
                    break
                if what is _TENSOR:
                    try:
                        buffer = storages.get(value.untyped_storage().data_ptr())
                    except Exception:  # noqa: BLE001 - no storage to share (sparse, nested): nothing to copy
                        continue
                    if buffer is not None:
                        changes.setdefault(at, {})[key] = value.clone()
                        routes.append(f"{_route(_where(queue, at), holder, key)} <- {name}.{buffer}")
                elif level < MAX_DEPTH:
                    queue.append((value, level + 1, at, key))
                else:
                    deep = _route(_where(queue, at), holder, key)
                    say_once(("deep", deep), f"boundary: {deep} ({type(value).__name__}) lies deeper than {MAX_DEPTH} "
                                             "levels and was not compared with the verify graph's buffers")
        except Exception as exc:  # noqa: BLE001 - a shape that cannot be walked is said, not raised
            where = _where(queue, at)
            say_once(("walk", where, type(holder)), f"boundary: could not walk {where} ({type(holder).__name__}: "
                                                    f"{type(exc).__name__}: {exc}); the rest of it was not compared")
        at += 1
    for at in reversed(range(len(queue))):  # a holder's index is below its values'
        if at not in changes:
            continue
        holder, _, parent, key = queue[at]
        fresh = _put(holder, changes[at], _where(queue, at))
        if fresh is not None and parent >= 0:
            changes.setdefault(parent, {})[key] = fresh
        elif fresh is not None:
            result = fresh
    for route in routes:
        metrics.count_boundary_copy(route)  # every copy, every step: /metrics keeps what log rotation drops
        say_once(route, f"boundary: {route} shared the verify graph's buffers; copied where it leaves the worker "
                        "(a route the fence's checks missed: please report it)")
    return result, routes


def _where(queue: list, at: int) -> str:
    """The route to the holder at `at` in the walk's queue, from the result's type down."""
    holder, _, parent, key = queue[at]
    return type(holder).__name__ if parent < 0 else _route(_where(queue, parent), queue[parent][0], key)


def _route(where: str, holder, key) -> str:
    """The route to a value, as reported: sequence items are one route whatever the index."""
    what = _kind(type(holder))
    return f"{where}[]" if what is _SEQUENCE else f"{where}[{key!r}]" if what is _MAPPING else f"{where}.{key}"


def _put(holder, changes: dict, where: str):
    """The copies put in place; a holder that refuses that (a tuple, a frozen struct) is
    rebuilt, and the rebuilt one returned for its own holder to take."""
    if not isinstance(holder, tuple):
        try:
            for key, value in changes.items():
                if isinstance(holder, (list, dict)):
                    holder[key] = value
                else:
                    setattr(holder, key, value)
            return None
        except Exception:  # noqa: BLE001 - refused in place: rebuilt below
            pass
    try:
        return holders.replaced(holder, changes)
    except Exception as exc:  # noqa: BLE001 - said, never raised
        say_once(("put", where, type(holder)), f"boundary: could not replace the copies in {where} "
                                               f"({type(holder).__name__}: {type(exc).__name__}: {exc}); it still shares the buffers")
        return None


def say_once(key, text: str) -> None:
    if key not in _said:
        _said.add(key)
        log.emit(f"folded_fence {text}", adapter="folded_fence")
