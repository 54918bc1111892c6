"""Who reads a verify step's logits after the worker returns, shown from the engine's code.

On 0.5.23's decode graph the result's `logits_output.next_token_logits` is a slice of the graph's
own output, which the next replay rewrites. The boundary check (fence_boundary) copies every
tensor a result shares with the epilogue's memory; this one it may leave in place only where no
code reads it after the worker returns. That is shown by following the values (engine.flow):

- the result, from every call of `forward_batch_generation` in the scheduler's methods (its MRO,
  read from source), through what the scheduler keeps it in (its result queue), what it hands it
  to (the batch result processor, the metrics reporter, the readback's `copy_to_cpu`, the output
  and logprob processors, resolved from their construction sites), and every attribute it is kept
  in: no load of `.next_token_logits` from its `logits_output` (a test of identity, `is None`,
  reads no logits);
- the worker's logits output, from every `.logits_output` its methods (DSparkWorkerV2's MRO) and
  what they call read: kept in no attribute of the worker or of anything that outlives the step.

Any place the following cannot see past (engine.flow's gaps) voids the proof, and the copy stays.
At run time a rank leaves them only after watching: where the proof holds, the first WATCH_STEPS
results that carry a logits output still have their logits copied, and each such logits output
reports any read of `next_token_logits` made after the worker returned, by any code but the pack's
(an `is None` test excepted, read from the caller's bytecode), for as long as it lives. One read
and the rank copies them at every step from then on, saying where the read came from; the
proof's verdict and the watch's are said once each.
"""

from __future__ import annotations

import ast
import dis
import functools
import importlib
import sys
from typing import NamedTuple, Optional

from ..engine import flow, proofs
from ..framework import log

SCHEDULER = ("sglang.srt.managers.scheduler", "Scheduler")
WORKER = ("sglang.srt.speculative.dspark_components.dspark_worker_v2", "DSparkWorkerV2")
RESULT = ("sglang.srt.managers.utils", "GenerationBatchResult")
LOGITS = ("sglang.srt.layers.logits_processor", "LogitsProcessorOutput")
RETURNS = "forward_batch_generation"  # where the scheduler receives a step's result
HOLDER, LOGITS_FIELD = "logits_output", "next_token_logits"
ROUTE = f"{HOLDER}.{LOGITS_FIELD}"
FORMAT = 1  # the verdict's layout: stored proofs of another layout are not read


class Verdict(NamedTuple):
    """unread: no code reads the logits after the worker returns (the proof holds); why: the
    reason in a sentence; classes: (module, name) of the result and logits classes judged, which
    the run-time check compares with what the worker really returns; followed: functions read."""
    unread: bool
    why: str
    classes: tuple = ()
    followed: int = 0


KEPT_READS = 32  # proofs kept by the files they read, for trees that differ elsewhere (doctored copies)


def verdict(engine) -> Verdict:
    """The proof for `engine` (installed or a source tree), kept across processes: under the content
    of every .py file of its tree, and under the files the following read (their content, or that a
    module is absent), which another tree differing only elsewhere reuses."""
    files = dict(engine.files())
    key = (FORMAT, proofs.tree_digest(sorted(files.items())), proofs.pack_digest())
    found = proofs.get("logits-readers", key)
    if isinstance(found, tuple) and len(found) == len(Verdict._fields):
        return Verdict(*found)
    reads_key = (FORMAT, proofs.pack_digest())  # every tree's proofs by what they read, newest first
    by_reads = proofs.get("logits-readers-reads", reads_key)
    by_reads = by_reads if isinstance(by_reads, tuple) else ()
    for reads, kept in by_reads:
        if all((files.get(module) is None) if digest is None else
               (files.get(module) is not None and proofs.content_digest(files[module]) == digest)
               for module, digest in reads):
            proofs.put("logits-readers", key, kept)
            return Verdict(*kept)
    found, read = _judge(files)
    reads = tuple(sorted((module, None if path is None else proofs.content_digest(path)) for module, path in read.items()))
    proofs.put("logits-readers", key, tuple(found))
    proofs.put("logits-readers-reads", reads_key, ((reads, tuple(found)),) + by_reads[:KEPT_READS - 1])
    return found


def _judge(files: dict) -> tuple[Verdict, dict]:
    """(the verdict, module -> path or None: what the following read)."""
    sources = flow.Sources(files)
    return _verdict(sources), sources.read


def _verdict(sources) -> Verdict:
    named = {key: sources.class_named(*key) for key in (SCHEDULER, WORKER, RESULT, LOGITS)}
    missing = [f"{module}.{name}" for (module, name), cls in named.items() if cls is None]
    if missing:
        return Verdict(False, f"{missing[0]} is not a class this engine's sources define, so what reads the logits "
                              f"cannot be followed")
    result, logits = named[RESULT], named[LOGITS]
    holds = {(result, HOLDER): logits}
    after = flow.Analysis(sources, [named[SCHEDULER]], flow.Question(
        born=lambda fn, node: flow.value(result) if _calls(node, RETURNS) else None,
        holds=holds, read=(logits, LOGITS_FIELD))).run()
    within = flow.Analysis(sources, [named[WORKER]], flow.Question(
        born=lambda fn, node: flow.value(logits) if _loads(node, HOLDER) else None,
        holds=holds, read=(logits, LOGITS_FIELD), kept_is_gap=True)).run()
    classes = ((result.module, result.name), (logits.module, logits.name))
    followed = len(after.functions) + len(within.functions)
    if after.reads:
        first = min(after.reads)
        return Verdict(False, f"{first.said()} reads {ROUTE} after the worker returns"
                              + (f" (and {len(after.reads) - 1} more)" if len(after.reads) > 1 else ""), classes, followed)
    gaps = sorted(after.gaps) + sorted(within.gaps)
    if gaps:
        return Verdict(False, f"not shown unread: {gaps[0].said()}" + (f" (and {len(gaps) - 1} more)" if len(gaps) > 1 else ""),
                       classes, followed)
    return Verdict(True, f"no code reads {ROUTE} after the worker returns ({followed} functions followed from "
                         f"the scheduler's {RETURNS} calls and the worker's methods)", classes, followed)


def _calls(node, name: str) -> bool:
    return isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == name


def _loads(node, name: str) -> bool:
    return isinstance(node, ast.Attribute) and node.attr == name


# ------------------------------------------------------------------ at run time, in a rank

WATCH_STEPS = 16  # results with a logits output whose logits are copied and watched before any is left
_PROBE = object()
_decided = _PROBE  # (result type, logits type) the proof covers, None: the logits are copied
_watch_left = WATCH_STEPS
_changed: list = []  # called when what leaving() answers changes (fence_boundary remaps)
_said: set = set()
_PACK = __name__.partition(".")[0]


def decide(spec=_PROBE) -> None:
    """What the rank does with the graph's logits (tests, benchmarks): `spec` (result type,
    logits type) to leave them after the watch, None to copy them, or by default what the
    installed engine's proof says at the first check."""
    global _decided, _watch_left
    _decided, _watch_left = spec, WATCH_STEPS
    _said.clear()
    _notify()


def watched_for(steps: int) -> None:
    """How many results are watched before the logits are left (tests, benchmarks: 0 leaves them at once)."""
    global _watch_left
    _watch_left = steps
    _notify()


def when_changed(callback) -> None:
    _changed.append(callback)


def _notify() -> None:
    for callback in _changed:
        callback()


def decision():
    """(result type, logits type) where the proof holds for the installed engine and the classes
    that run are the ones it judged; None (copied) otherwise. Decided once, said once."""
    global _decided
    if _decided is _PROBE:
        from ..engine.installed import InstalledEngine

        try:
            found = verdict(InstalledEngine())
            spec = _running(found.classes) if found.unread else None
            why = found.why if spec is not None or not found.unread else \
                f"the classes the engine returns are not the ones its code was judged by ({found.why})"
        except Exception as exc:  # noqa: BLE001 - not shown: the copy stays
            spec, why = None, f"the proof could not be made ({type(exc).__name__}: {exc})"
        _decided = spec
        _say("decided", f"boundary: the graph's logits ({ROUTE}) " + (
            f"are left in place after the first {WATCH_STEPS} steps with logits, watched: {why}" if spec is not None
            else f"are copied where they leave the worker: {why}"))
    return _decided


def _running(classes: tuple) -> Optional[tuple]:
    """The result and logits classes the proof judged, as the engine's modules hold them."""
    found = []
    for module, name in classes:
        cls = getattr(importlib.import_module(module), name, None)
        if not isinstance(cls, type) or cls.__module__ != module or cls.__qualname__ != name:
            return None
        found.append(cls)
    return tuple(found)


def leaving():
    """The spec fence_boundary leaves the logits by: set once the watch is over with no read."""
    spec = decision()
    return spec if spec is not None and _watch_left <= 0 else None


def watching() -> bool:
    return _decided is not _PROBE and _decided is not None and _watch_left > 0


def watch(result) -> None:
    """A result leaving the worker while the watch lasts: its logits output reports any later read."""
    global _watch_left
    spec = _decided
    if spec is None or spec is _PROBE or _watch_left <= 0 or type(result) is not spec[0]:
        return
    logits = getattr(result, HOLDER, None)
    if type(logits) is not spec[1]:
        return
    logits.__class__ = _watched(spec[1])
    _watch_left -= 1
    if _watch_left == 0:
        _say("left", f"boundary: {WATCH_STEPS} results watched, no read of {ROUTE} after the worker returned; "
                     "the graph's logits are left in place from now")
        _notify()


@functools.lru_cache(maxsize=4)
def _watched(cls: type) -> type:
    """`cls` with `next_token_logits` read through a property that reports reads."""
    def read(self):
        frame = sys._getframe(1)
        if frame.f_globals.get("__name__", "").partition(".")[0] != _PACK and not _identity_test(frame):
            _read_late(frame)
        return self.__dict__[LOGITS_FIELD]

    def write(self, value):
        self.__dict__[LOGITS_FIELD] = value

    return type(cls.__name__, (cls,), {LOGITS_FIELD: property(read, write), "__module__": cls.__module__,
                                       "__qualname__": cls.__qualname__, "__slots__": ()})


_IDENTITY = {"POP_JUMP_IF_NONE", "POP_JUMP_IF_NOT_NONE", "POP_JUMP_FORWARD_IF_NONE", "POP_JUMP_FORWARD_IF_NOT_NONE",
             "POP_JUMP_BACKWARD_IF_NONE", "POP_JUMP_BACKWARD_IF_NOT_NONE"}


@functools.lru_cache(maxsize=256)
def _instructions(code) -> tuple:
    return tuple(dis.get_instructions(code))


def _identity_test(frame) -> bool:
    """The caller only compares what it read with None (`x.next_token_logits is None`): the
    instruction after its attribute load jumps on None, or loads None for `is`."""
    found = _instructions(frame.f_code)
    at = next((i for i, ins in enumerate(found) if ins.offset == frame.f_lasti), None)
    if at is None or at + 1 >= len(found):
        return False
    following = found[at + 1]
    if following.opname in _IDENTITY:
        return True
    return (following.opname == "LOAD_CONST" and following.argval is None and at + 2 < len(found)
            and found[at + 2].opname == "IS_OP")


def _read_late(frame) -> None:
    global _decided
    if _decided is None:
        return
    _decided = None
    where = f"{frame.f_code.co_filename}:{frame.f_lineno} ({frame.f_code.co_name})"
    _say("read", f"boundary: {where} read {ROUTE} after the worker returned, which the engine's code was not shown "
                 "to do: the graph's logits are copied where they leave the worker, at every step from now "
                 "(please report it)")
    _notify()


def _say(key, text: str) -> None:
    if key not in _said:
        _said.add(key)
        log.emit(f"folded_fence {text}", adapter="folded_fence")
