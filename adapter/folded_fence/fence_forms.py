"""What the fence does at each call of an escape route: the general form, and the cheap form
with its run-time proof (folded_fence decides which, from the engine's source).

General form: run the engine's own path, then, if any tensor of what it returned shares
storage with the epilogue's persistent buffers, hand back a copy of it whose every tensor
field owns its memory (one launch, accept_snapshot), every other field carried over, of
the returned object's own type (a subclass keeps its extra fields). What the engine
returned decides, not the caller's keyword; a whole buffer is a view like any other.

Cheap form (`TargetVerifyExecutor.accept_and_finalize` only): on the folded path, do what
the engine's folded branch does (`note_static_verify(bs)` where the release has it) and
snapshot the `[:bs]` views `read_accept` would make, cached per batch size, instead of
running the branch and copying its result. folded_fence builds it only when the branch,
`read_accept` and `AcceptOuts` are exactly the checked source with nothing around them.
It is also checked where it runs: in each process, the first PROOF_CALLS folded calls
per batch size (again whenever the executor's class, the epilogue, its class or one of
its buffers changes, or a buffer is re-pointed in place) run the engine's own path under
a profiler and compare it with what the cheap form would hand out: the same Python
frames (accept_and_finalize, note_static_verify and what it calls, read_accept; a
decorator, a descriptor, an override, a __post_init__ or a tensor subclass's hook would
be one more), the same struct type, and every field the very view the cheap form
snapshots (storage, offset, shape, stride, dtype). Those calls
return the engine's result, copied. On any difference the process takes the general
form for good and says why, once. Once trusted, each call checks that nothing it relies
on was swapped since: by identity the objects it holds (the epilogue, the classes,
read_accept, the AcceptOuts that read_accept builds, the buffers, no instance attribute
shadowing read_accept), and by memory the buffers: each still lies where it lay when its
views were cut (storage, offset, sizes, strides, dtype: accept_snapshot.current, in C
where the kernel library is loaded).
"""

from __future__ import annotations

import functools
import inspect
import operator
import os
import sys
from typing import Optional

import torch

from . import accept_snapshot, holders
from ..framework import patching
from .fence_boundary import persistent_storages, say_once

PROOF_CALLS = 2  # folded calls per batch size that run the engine's path and are compared


def detach_shared(result, epilogue):
    """`result` itself, or, where a tensor field of it shares storage with the epilogue's
    buffers, a copy of it whose every tensor field owns its memory."""
    if result is None or epilogue is None:
        return result
    storages = persistent_storages(epilogue)
    if isinstance(result, torch.Tensor):
        return result.clone() if result.untyped_storage().data_ptr() in storages else result
    tensors = [(key, value) for key, value in holders.items(result) if isinstance(value, torch.Tensor)]
    if any(value.untyped_storage().data_ptr() in storages for _, value in tensors):
        return accept_snapshot.detach(result, [key for key, _ in tensors])
    return result


@functools.lru_cache(maxsize=None)  # one wrapper per route: deciding again re-wraps nothing
def general(epilogue_attribute: str):
    """The general form for a route whose instance holds the epilogue as `epilogue_attribute`."""
    def fence(wrapped, instance, args, kwargs):
        return detach_shared(wrapped(*args, **kwargs), getattr(instance, epilogue_attribute, None))

    fence.__qualname__ = f"general_form[{epilogue_attribute}]"
    return fence


@functools.lru_cache(maxsize=None)  # one per checked engine: its proofs survive deciding again
def cheap_form(fields: tuple, buffers: tuple, notes: bool, accept_outs: type, folded, read) -> "CheapForm":
    return CheapForm(fields, buffers, notes, accept_outs, folded, read)


class CheapForm:
    """The folded branch done by the fence, proven in each process (see the module's doc).

    fields: AcceptOuts' fields; buffers: the epilogue attributes read_accept slices for
    them, in the same order; notes: the branch calls note_static_verify(bs) first;
    folded, read: the checked accept_and_finalize and read_accept functions."""

    def __init__(self, fields: tuple, buffers: tuple, notes: bool, accept_outs: type, folded, read):
        self.fields, self.buffers = fields, operator.attrgetter(*buffers)
        self.notes, self.accept_outs = notes, accept_outs
        # Built from the copies positionally where AcceptOuts takes exactly its fields so (a
        # struct or dataclass without kw_only): no dict per call, about 1 us less on a CPU.
        self.positional = takes_positionally(accept_outs, fields)
        self.folded, self.read = folded, read
        self.read_globals = read.__globals__  # where read_accept finds AcceptOuts at each call
        self.views: dict = {}      # bs -> (the buffer objects, their [:bs] views, aliases of the buffers as they lay then)
        self.trusted: set = set()  # batch sizes proven for `context`
        self.proofs: dict = {}     # bs -> proofs passed for `context`
        self.context: tuple = ()   # (executor class, epilogue, epilogue class) the proofs hold for
        self.off: Optional[str] = None  # why this process took the general form for good

    def __call__(self, wrapped, instance, args, kwargs):
        if kwargs.get("folded_accept") and kwargs.get("bs") in self.trusted:
            executor_class, proven, _ = self.context
            epilogue, bs = instance.verify_epilogue, kwargs["bs"]
            buffers, views, was = self.views[bs]
            if (epilogue is proven and type(instance) is executor_class and type(epilogue).read_accept is self.read
                    and "read_accept" not in epilogue.__dict__ and self.read_globals.get("AcceptOuts") is self.accept_outs
                    and accept_snapshot.current(buffers, self.buffers(epilogue), was)):
                if self.notes:
                    epilogue.note_static_verify(bs)
                copies = accept_snapshot.snapshot(views)
                return self.accept_outs(*copies) if self.positional else self.accept_outs(**dict(zip(self.fields, copies)))
        return self._engine_path(wrapped, instance, args, kwargs)

    def _views(self, epilogue, bs: int) -> list:
        """read_accept's [:bs] views, cached while each buffer is the same object over the same
        memory (accept_snapshot.views_current); a buffer replaced, or re-pointed in place
        (set_, .data =, a resize_), voids the proofs at this batch size: cut again, proven again."""
        bufs, hit = self.buffers(epilogue), self.views.get(bs)
        if hit is None or not accept_snapshot.current(hit[0], bufs, hit[2]):
            hit = self.views[bs] = (bufs, [buf[:bs] for buf in bufs], tuple(buf.detach() for buf in bufs))
            self.trusted.discard(bs)
            self.proofs.pop(bs, None)
        return hit[1]

    def _engine_path(self, wrapped, instance, args, kwargs):
        """The engine's own path, its result copied; on the folded path, a proof as well."""
        epilogue = getattr(instance, "verify_epilogue", None)
        # Proofs are kept per batch size: one that is no plain int is never trusted.
        if self.off is not None or not kwargs.get("folded_accept") or epilogue is None or type(kwargs["bs"]) is not int:
            return detach_shared(wrapped(*args, **kwargs), epilogue)
        context = (type(instance), epilogue, type(epilogue))
        if len(self.context) != 3 or not all(map(operator.is_, context, self.context)):
            self.context, self.trusted, self.proofs = context, set(), {}
        bs = kwargs["bs"]
        views = self._views(epilogue, bs)
        calls, result = traced(wrapped, args, kwargs)
        if calls is None:  # not seen: this call proves nothing, either way
            profiler = type(sys.getprofile())
            say_once(("cheap form", "unseen"), f"cheap form not proven while {profiler.__module__}.{profiler.__qualname__} "
                                             "profiles this process (a profiler Python cannot put back); the engine's "
                                             "own result is copied (the general form) until it stops")
            return detach_shared(result, epilogue)
        why = self._difference(wrapped, calls, result, epilogue, views)
        if why is not None:
            self.off, self.trusted = why, set()
            say_once(("cheap form", why), f"cheap form off: {why}; this process copies the engine's own result "
                                          "instead (the general form)")
        else:
            self.proofs[bs] = self.proofs.get(bs, 0) + 1
            if self.proofs[bs] >= PROOF_CALLS:
                self.trusted.add(bs)
                self._bind_in_c()
        return detach_shared(result, epilogue)

    def _bind_in_c(self) -> None:
        """Where the kernel library tests the views, the class holds its fenced_method: this form's
        trusted call in C (no wrapt hop, no Python frame), which hands everything else to this form.
        Kept for the form (one per checked engine), so applying it again binds it so at once."""
        library = accept_snapshot.checks_library()
        if library is not None:
            patching.bind_faster(self, patching.for_functions(
                lambda original: library.fenced_method(original, self, vars(accept_snapshot), library.snapshot)))

    def _difference(self, wrapped, calls: list, result, epilogue, views: list) -> Optional[str]:
        """Why the cheap form would not have done what the engine's path just did, or None."""
        if getattr(wrapped, "__func__", None) is not self.folded:
            return f"accept_and_finalize is {wrapped!r}, not the function checked"
        read = inspect.getattr_static(epilogue, "read_accept", None)
        if read is not self.read:
            return f"{type(epilogue).__name__}.read_accept is {read!r}, not the function checked"
        note = getattr(inspect.getattr_static(epilogue, "note_static_verify", None), "__code__", None)
        expected = [note, self.read.__code__] if self.notes else [self.read.__code__]
        for path in calls:  # code objects compare by identity: an equal copy elsewhere is another function
            if (path[0] is not self.folded.__code__
                    or len(path) > 1 and not any(path[1] is code for code in expected)
                    or len(path) > 2 and path[1] is not note):
                return f"the engine's path runs {_name(path[-1])}, which the cheap form would not"
        direct = [path[1] for path in calls if len(path) == 2]
        if len(direct) != len(expected) or not all(map(operator.is_, direct, expected)):
            return f"the engine's folded branch made other calls than {', '.join(map(_name, expected))}"
        if type(result) is not self.accept_outs:
            return f"read_accept returned a {type(result).__qualname__}, not {self.accept_outs.__qualname__}"
        for name, view in zip(self.fields, views):
            if not same_view(getattr(result, name), view):
                return f"the engine's {name} is not the view the cheap form copies"
        return None


def takes_positionally(cls, fields: tuple) -> bool:
    """cls(*values) is cls(**dict(zip(fields, values))): its signature is exactly `fields`, in
    order, each positional-or-keyword."""
    try:
        params = tuple(inspect.signature(cls).parameters.values())
    except (TypeError, ValueError):
        return False
    return tuple(p.name for p in params) == tuple(fields) and all(p.kind is p.POSITIONAL_OR_KEYWORD for p in params)


def traced(wrapped, args, kwargs) -> tuple[Optional[list], object]:
    """Call `wrapped` with every Python frame it enters recorded, each as the path of code
    objects from the first frame below this one down to it; no profiler of the process's
    own is lost, it is put back after the call. Where the process's profiler is one that
    Python code cannot set again (cProfile's on Python 3.11: an object, not a function),
    `wrapped` runs untraced and the calls are None."""
    before = sys.getprofile()
    if before is not None and not callable(before):
        return None, wrapped(*args, **kwargs)
    calls, here = [], sys._getframe()

    def note(frame, event, arg):
        if event == "call":
            path = []
            while frame is not None and frame is not here:
                path.append(frame.f_code)
                frame = frame.f_back
            calls.append(path[::-1])

    sys.setprofile(note)
    try:
        result = wrapped(*args, **kwargs)
    finally:
        sys.setprofile(before)
    return calls, result


def same_view(mine, view: torch.Tensor) -> bool:
    return (type(mine) is type(view) and mine.untyped_storage().data_ptr() == view.untyped_storage().data_ptr()
            and mine.storage_offset() == view.storage_offset() and mine.shape == view.shape
            and mine.stride() == view.stride() and mine.dtype == view.dtype and mine.device == view.device)


def _name(code) -> str:
    if code is None:
        return "a callable without Python code"
    return f"{getattr(code, 'co_qualname', code.co_name)} ({os.path.basename(code.co_filename)}:{code.co_firstlineno})"
