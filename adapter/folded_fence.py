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

import os
from collections.abc import Mapping

from . import accept_snapshot, patching
from .contract import KEYWORD_ONLY, POSITIONAL, Contract, Patch, Plan, call_sites, package_dir
from .flags import parse_switch

NAME = "folded_fence"
FLAG = "DSV41_FOLDED_FENCE"
SUMMARY = "detach DSpark folded verify results from the verify graph's persistent buffers"
# The flag value doctor and the compatibility matrix check the engine with.
CHECK_VALUE = "1"

PACKAGE = "sglang.srt.speculative.dspark_components"
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


def _refuse_unpatched_readers(contract: Contract) -> None:
    """A module of the speculative package outside ESCAPES that takes epilogue views
    (other than as a write target) is an escape route in a module the fence never sees."""
    root = package_dir(contract.module, "sglang.srt.speculative")
    for path in sorted(root.rglob("*.py")):
        name = "sglang.srt.speculative." + ".".join(path.relative_to(root).with_suffix("").parts)
        text = path.read_text(encoding="utf-8", errors="replace")
        if name in ESCAPES or not any(f".{reader}(" in text for reader in READERS):
            continue
        for site in call_sites(text, READERS):
            if not site.write_target:
                raise contract.refuse(
                    f"{name}:{site.function}",
                    f"line {site.line} takes {site.method}() views in a module the fence does not patch",
                )


def check(module) -> Plan:
    """Check the contract in `module` and say what installing would do; patches nothing."""
    key = module.__name__
    contract = Contract(NAME, module)
    if key not in ESCAPES:
        raise contract.refuse("<module>", f"not a module the fence patches ({', '.join(ESCAPES)})")
    superseded = []
    if key == VERIFY:
        contract.struct_fields("AcceptOuts", FIELDS)
        contract.params("DsparkVerifyEpilogue.read_accept", {"self": POSITIONAL, "bs": POSITIONAL})
        contract.params("TargetVerifyExecutor.accept_and_finalize", ESCAPE_PARAMS["TargetVerifyExecutor.accept_and_finalize"])
        _refuse_unpatched_readers(contract)
    patches = []
    escapes = ESCAPES[key]
    seen = set()
    for site in call_sites(contract.source(), READERS + (UPSTREAM_SNAPSHOT,)):
        if site.method == UPSTREAM_SNAPSHOT:
            superseded.append(site.function)
            continue
        if site.write_target or site.function in NOT_ESCAPES.get(key, ()):
            continue
        if site.function not in escapes:
            raise contract.refuse(
                site.function,
                f"line {site.line} hands out {site.method}() views, an escape route the fence does not cover",
            )
        seen.add(site.function)
    for function in sorted(seen):
        owner_name, _, attr = function.rpartition(".")
        contract.params(function, ESCAPE_PARAMS[function])
        patches.append(Patch(contract.attr(owner_name), attr, escapes[function]))
    if key == VERIFY and "TargetVerifyExecutor.accept_and_finalize" not in seen:
        if "TargetVerifyExecutor.accept_and_finalize" in superseded:
            contract.attr(f"DsparkVerifyEpilogue.{UPSTREAM_SNAPSHOT}")
            if not patches:
                return Plan(
                    "superseded",
                    f"the engine snapshots the folded result itself (DsparkVerifyEpilogue.{UPSTREAM_SNAPSHOT})",
                )
        else:
            raise contract.refuse(
                "TargetVerifyExecutor.accept_and_finalize",
                "no longer returns read_accept(bs) on the folded path; what its result aliases is unknown",
            )
    if not patches:
        return Plan("not needed", "no epilogue views escape here")
    return Plan("applied", "fenced " + ", ".join(f"{p.owner.__name__}.{p.name}" for p in patches), patches)


def install(module) -> Plan:
    return patching.install_plan(check(module), NAME)


def uninstall(module) -> None:
    for function in ESCAPES.get(module.__name__, {}):
        owner_name, _, attr = function.rpartition(".")
        owner = getattr(module, owner_name, None)
        if owner is not None:
            patching.remove(owner, attr, NAME)
