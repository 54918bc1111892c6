"""Folded-result fence (DSV41_FOLDED_FENCE).

On DSpark's folded path the accept kernels run inside the target-verify CUDA graph
and leave their results in `DsparkVerifyEpilogue`'s persistent buffers. The engine
hands views of those buffers to the scheduler, whose overlapped host readback runs
on a copy stream while the next verify replay already rewrites them, so TP ranks
can read different steps and commit different token counts (upstream #42465).

The fence copies each escaping result off the buffers on the forward stream, right
where it escapes, before anything else is queued; the readback then reads memory no
replay touches. `read_accept` itself is left alone: from 0.5.22 the captured graph
writes through it. The eager path already returns fresh tensors and is untouched.
"""

from __future__ import annotations

import ast
import os
from collections.abc import Mapping

from . import accept_snapshot
from .contract import (KEYWORD_ONLY, POSITIONAL, Contract, Patch, Plan, combine, package_dir, target_modules,
                       within)
from .flags import parse_switch

NAME = "folded_fence"
FLAG = "DSV41_FOLDED_FENCE"
SUMMARY = "detach DSpark folded verify results from the verify graph's persistent buffers"
CHECK_VALUE = "1"  # the setting doctor's engine check and the compatibility matrix use

SPEC = "sglang.srt.speculative"
PACKAGE = f"{SPEC}.dspark_components"
VERIFY = f"{PACKAGE}.dspark_verify"
SAMPLING_ACCEPT_GRAPH = f"{PACKAGE}.dspark_sampling_accept_graph"
WORKER = f"{PACKAGE}.dspark_worker_v2"
# (module, required): the sampling-accept graph exists from 0.5.23 only.
TARGETS = ((VERIFY, True), (SAMPLING_ACCEPT_GRAPH, False), (WORKER, True))

FIELDS = ("correct_len", "bonus", "cap_trim_lens", "commit_lens", "new_seq_lens", "out_tokens")
# The epilogue's readers: each returns views of its persistent buffers.
READERS = ("read_accept", "read_block_accept_lens")
# The engine's own fix (upstream PR for #42465) snapshots instead of reading views.
UPSTREAM_SNAPSHOT = "snapshot_accept"


def parse(environ: Mapping[str, str] = os.environ) -> bool:
    return parse_switch(FLAG, environ)


def detach_accept(outs):
    """A copy of an `AcceptOuts` whose fields own their memory (queued on the current
    stream, which is the forward stream where the verify ran). On CUDA one fresh block
    filled by one launch, else plain clones (accept_snapshot); the fields are passed
    in order, which `check` pins (AcceptOuts has exactly FIELDS, in this order)."""
    return accept_snapshot.detach(outs, FIELDS)


def _fence_folded_accept(wrapped, instance, args, kwargs):
    outs = wrapped(*args, **kwargs)
    # accept_and_finalize is keyword-only (checked), so the flag is in kwargs.
    return detach_accept(outs) if kwargs.get("folded_accept") else outs


def _fence_region_accept(wrapped, instance, args, kwargs):
    outs = wrapped(*args, **kwargs)
    return None if outs is None else detach_accept(outs)


def _fence_block_accept_lens(wrapped, instance, args, kwargs):
    lens = wrapped(*args, **kwargs)
    # A view (of block_accept_lens_buf) escapes; the eager sum is already fresh.
    return lens.clone() if lens is not None and lens._base is not None else lens


# Every function that calls an epilogue reader, per module. A reader call elsewhere
# (other than as an `out=` write target) is an escape route the fence does not
# cover, and the fence refuses rather than report a partial fix as applied.
ESCAPES = {
    VERIFY: {"TargetVerifyExecutor.accept_and_finalize": _fence_folded_accept},
    SAMPLING_ACCEPT_GRAPH: {"DsparkSamplingAcceptGraph.run": _fence_region_accept},
    WORKER: {"DSparkWorkerV2._block_accept_lens": _fence_block_accept_lens},
}
# Reader calls that are not escapes: a captured write through the views, and the
# upstream fix's snapshot, which copies them.
NOT_ESCAPES = {VERIFY: {"DsparkVerifyEpilogue._accept_static_greedy", f"DsparkVerifyEpilogue.{UPSTREAM_SNAPSHOT}"}}
# Parameters the wrappers rely on, per escaping function.
ESCAPE_PARAMS = {
    "TargetVerifyExecutor.accept_and_finalize": {"folded_accept": KEYWORD_ONLY, "bs": KEYWORD_ONLY},
    "DsparkSamplingAcceptGraph.run": {"bs": KEYWORD_ONLY},
    "DSparkWorkerV2._block_accept_lens": {"folded_accept": KEYWORD_ONLY, "bs": KEYWORD_ONLY},
}


def _reader_uses(contract: Contract, allowed) -> list:
    """Every read of an epilogue reader in the module, other than a write target (passed
    as `out=`/`*_out=`: the callee writes through the views); one outside `allowed` is an
    escape route the fence does not cover, and it refuses."""
    written = {id(kw.value.func) for found in contract.all_calls() for kw in found.node.keywords
               if kw.arg and (kw.arg == "out" or kw.arg.endswith("_out")) and isinstance(kw.value, ast.Call)}
    return [f for reader in READERS for f in contract.only_used_in(
        reader, allowed, attribute=True, required=False, ignore=lambda f: id(f.node) in written)]


def _refuse_unpatched_readers(contract: Contract) -> None:
    """A module of the speculative package outside ESCAPES that takes epilogue views is
    an escape route in a module the fence never sees."""
    root = package_dir(contract.module, SPEC)
    for path in sorted(root.rglob("*.py")):
        name = f"{SPEC}." + ".".join(path.relative_to(root).with_suffix("").parts)
        text = path.read_text(encoding="utf-8", errors="replace")
        if name in ESCAPES or not any(reader in text for reader in READERS):
            continue
        _reader_uses(Contract(NAME, contract.module, name=name, source=text), ())


def _module_plan(contract: Contract) -> Plan:
    """The escape routes of one module, each checked; patches nothing."""
    key = contract.module.__name__
    if key == VERIFY:
        contract.struct_fields("AcceptOuts", FIELDS)
        contract.params("DsparkVerifyEpilogue.read_accept", {"self": POSITIONAL, "bs": POSITIONAL})
        contract.params("TargetVerifyExecutor.accept_and_finalize", ESCAPE_PARAMS["TargetVerifyExecutor.accept_and_finalize"])
        _refuse_unpatched_readers(contract)
    escapes = ESCAPES[key]
    found = _reader_uses(contract, tuple(escapes) + tuple(NOT_ESCAPES.get(key, ())))
    seen = sorted({f.function for f in found if f.function in escapes})
    snapshots = {f.function for f in contract.uses(UPSTREAM_SNAPSHOT, attribute=True)}
    patches = []
    for function in seen:
        owner_name, _, attr = function.rpartition(".")
        contract.params(function, ESCAPE_PARAMS[function])
        patches.append(Patch(contract.attr(owner_name), attr, escapes[function]))
    if key == VERIFY and "TargetVerifyExecutor.accept_and_finalize" not in seen:
        if not any(within(f, ("TargetVerifyExecutor.accept_and_finalize",)) for f in snapshots):
            raise contract.refuse(
                "TargetVerifyExecutor.accept_and_finalize",
                "no longer returns read_accept(bs) on the folded path; what its result aliases is unknown",
            )
        contract.attr(f"DsparkVerifyEpilogue.{UPSTREAM_SNAPSHOT}")
        if not patches:
            return Plan("superseded", f"the engine snapshots the folded result itself "
                                      f"(DsparkVerifyEpilogue.{UPSTREAM_SNAPSHOT})")
    if not patches:
        return Plan("not needed", "no epilogue views escape here")
    return Plan("applied", "fenced " + ", ".join(f"{p.owner.__name__}.{p.name}" for p in patches), patches)


def check(engine, enabled: bool, context) -> Plan:
    """What fencing every escape route takes on `engine`; patches nothing."""
    modules = target_modules(NAME, engine, TARGETS)
    return combine(NAME, engine.version, [_module_plan(Contract(NAME, module)) for module in modules.values()])
