"""The fence's run-time guarantee, where a verify step's results leave the worker.

The fence's drift checks read the engine's sources: an early warning, not a proof.
`DSparkWorkerV2.forward_batch_generation` is where a step's results leave the worker
for the scheduler, whose overlapped readback may run after the next verify replay
rewrote the epilogue's persistent buffers. There, every tensor the result holds (and
the objects it holds, one level down) is compared by storage with every tensor the
epilogue holds. One that shares storage is copied there, on the forward stream and
before the next replay is queued, so the readback still reads this step; and the
route is named once per process, since the fence's checks missed it.

Cost: one dict of the epilogue's storages and one storage lookup per result tensor,
every step (figures in the README's performance section).
"""

from __future__ import annotations

import os
import sys

import torch

_named: set = set()  # routes already reported in this process
_storages: dict = {}  # id(epilogue) -> (ids of its attribute values, storage address -> attribute)
_SKIP = frozenset((type(None), bool, int, float, str))


def check_results(wrapped, instance, args, kwargs):
    result = wrapped(*args, **kwargs)
    epilogue = getattr(instance, "_verify_epilogue", None)
    if epilogue is not None and result is not None:
        detach_escapes(result, epilogue)
    return result


def persistent_storages(epilogue) -> dict:
    """Storage address -> attribute name, for every tensor the epilogue holds; rebuilt
    only when one of its attributes is rebound (a buffer allocated late, or replaced)."""
    state = vars(epilogue)
    ids = tuple(map(id, state.values()))
    cached = _storages.get(id(epilogue))
    if cached is None or cached[0] != ids:
        cached = _storages[id(epilogue)] = (ids, {t.untyped_storage().data_ptr(): name for name, t in state.items()
                                                  if isinstance(t, torch.Tensor) and t.numel()})
    return cached[1]


def _tensors(result) -> list:
    """(where, holder, attribute, tensor) for every tensor the result holds, directly or in
    an object it holds (the next draft input, the logits output)."""
    found, top = [], type(result).__name__
    for name, value in vars(result).items():
        kind = type(value)
        if kind in _SKIP:
            continue
        if issubclass(kind, torch.Tensor):
            found.append((top, result, name, value))
        elif hasattr(value, "__dict__") and kind is not type:
            found += [(f"{top}.{name}", value, inner, t) for inner, t in vars(value).items() if isinstance(t, torch.Tensor)]
    return found


def detach_escapes(result, epilogue) -> list[str]:
    """Copy every tensor of `result` that shares storage with the epilogue's buffers;
    returns the routes found ("Holder.field <- Epilogue.buffer")."""
    storages, found = persistent_storages(epilogue), []
    for where, holder, name, tensor in _tensors(result):
        buffer = storages.get(tensor.untyped_storage().data_ptr()) if tensor.numel() else None
        if buffer is not None:
            setattr(holder, name, tensor.clone())
            found.append(f"{where}.{name} <- {type(epilogue).__name__}.{buffer}")
    for route in found:
        if route not in _named:
            _named.add(route)
            print(f"[sglang-adapters] pid={os.getpid()} folded_fence boundary: {route} shared the verify graph's "
                  "buffers; copied where it leaves the worker (a route the fence's checks missed: please report it)",
                  file=sys.stderr, flush=True)
    return found
