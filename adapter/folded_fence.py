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
import textwrap
from collections.abc import Mapping

from . import accept_snapshot, census
from .contract import KEYWORD_ONLY, POSITIONAL, Contract, Patch, Plan, combine, target_modules, within
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


# The census (adapter.census): every reference anywhere in the engine to an epilogue
# reader or to one of its persistent buffers must be at one of these sites.
EPILOGUE = "DsparkVerifyEpilogue"
# Reader calls whose views are written through (`out=` / `*_out=`), checked as such by
# _reader_uses in their module.
WRITE_TARGETS = {VERIFY: (f"{EPILOGUE}._accept",), SAMPLING_ACCEPT_GRAPH: ("sampling_accept_commit_lens",)}
# The epilogue's own methods that touch its buffers, reviewed on 0.5.16-0.5.23: they
# allocate them, pass them as write targets, copy out of them in place, or (the
# readers) hand out the views the escape routes return.
EPILOGUE_INTERNALS = ("__init__", "read_accept", "read_block_accept_lens", "_accept", "_accept_static_greedy",
                      "_static_accept_tail", "_scatter_future_relay", "run_static")
OVERLAP_UTILS = "sglang.srt.managers.overlap_utils"


def census_sites(buffers: frozenset) -> list:
    readers = frozenset(READERS)
    sites = [census.Site(module, function, readers, frozenset({census.ATTRIBUTE}), "escape route, fenced")
             for module, functions in ESCAPES.items() for function in functions]
    sites += [census.Site(module, function, readers, frozenset({census.ATTRIBUTE}), "checked not to escape")
              for module, functions in (*NOT_ESCAPES.items(), *WRITE_TARGETS.items()) for function in functions]
    sites.append(census.Site(VERIFY, EPILOGUE, readers, frozenset({census.DEFINITION}), "the readers' definitions"))
    sites += [census.Site(VERIFY, f"{EPILOGUE}.{method}", buffers, frozenset({census.ATTRIBUTE}),
                          "the epilogue's own use of its buffers", receiver="self") for method in EPILOGUE_INTERNALS]
    # FutureMap keeps a buffer of its own under one of these names (the epilogue scatters into
    # its relay by copy).
    sites.append(census.Site(OVERLAP_UTILS, "FutureMap", frozenset({"new_seq_lens_buf"}), frozenset({census.ATTRIBUTE}),
                             "FutureMap's own buffer of the same name", receiver="self"))
    return sites


def epilogue_buffers(contract: Contract) -> frozenset:
    """The persistent buffers the readers hand out views of, read from their source."""
    buffers = set()
    for reader in READERS:
        if not hasattr(contract.attr(EPILOGUE), reader):
            continue  # read_block_accept_lens exists from 0.5.23
        tree = ast.parse(textwrap.dedent(contract.function_source(f"{EPILOGUE}.{reader}")))
        buffers |= {n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute)
                    and isinstance(n.value, ast.Name) and n.value.id == "self"}
    if not buffers:
        raise contract.refuse(f"{EPILOGUE}.read_accept", "reads no buffer of the epilogue; what its views alias is unknown")
    return frozenset(buffers)


def _census(engine, verify) -> None:
    """No reference to a reader or a buffer outside the known sites (adapter.census)."""
    buffers = epilogue_buffers(Contract(NAME, verify))
    census.refuse_unknown(NAME, engine, set(READERS) | buffers, census_sites(buffers),
                          "an epilogue reader or persistent buffer, whose views the fence may not cover,")


def _module_plan(contract: Contract) -> Plan:
    """The escape routes of one module, each checked; patches nothing."""
    key = contract.module.__name__
    if key == VERIFY:
        contract.struct_fields("AcceptOuts", FIELDS)
        contract.params("DsparkVerifyEpilogue.read_accept", {"self": POSITIONAL, "bs": POSITIONAL})
        contract.params("TargetVerifyExecutor.accept_and_finalize", ESCAPE_PARAMS["TargetVerifyExecutor.accept_and_finalize"])
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
    plan = combine(NAME, engine.version, [_module_plan(Contract(NAME, module)) for module in modules.values()])
    if plan.state == "applied":
        _census(engine, modules[VERIFY])
    return plan
