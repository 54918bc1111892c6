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


def check_results(wrapped, instance, args, kwargs):
    result = wrapped(*args, **kwargs)
    epilogue = getattr(instance, "_verify_epilogue", None)
    if epilogue is not None and result is not None:
        detach_escapes(result, epilogue)
    return result


def persistent_storages(epilogue) -> dict:
    """Storage address -> attribute name, for every tensor the epilogue holds."""
    return {t.untyped_storage().data_ptr(): name for name, t in vars(epilogue).items()
            if isinstance(t, torch.Tensor) and t.numel()}


def _holders(result):
    """The result and the objects it holds directly (draft input, logits output)."""
    yield type(result).__name__, result
    for name, value in vars(result).items():
        if hasattr(value, "__dict__") and not isinstance(value, (torch.Tensor, type)):
            yield f"{type(result).__name__}.{name}", value


def detach_escapes(result, epilogue) -> list[str]:
    """Copy every tensor of `result` that shares storage with the epilogue's buffers;
    returns the routes found ("Holder.field <- Epilogue.buffer")."""
    storages, found = persistent_storages(epilogue), []
    for where, holder in _holders(result):
        for name, value in list(vars(holder).items()):
            if isinstance(value, torch.Tensor) and value.numel():
                buffer = storages.get(value.untyped_storage().data_ptr())
                if buffer is not None:
                    setattr(holder, name, value.clone())
                    found.append(f"{where}.{name} <- {type(epilogue).__name__}.{buffer}")
    for route in found:
        if route not in _named:
            _named.add(route)
            print(f"[sglang-adapters] pid={os.getpid()} folded_fence boundary: {route} shared the verify graph's "
                  "buffers; copied where it leaves the worker (a route the fence's checks missed: please report it)",
                  file=sys.stderr, flush=True)
    return found
