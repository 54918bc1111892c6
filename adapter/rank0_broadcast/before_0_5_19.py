"""Rank-0 broadcast on sglang 0.5.16 - 0.5.18, which have no SpecTpSync: the pack wraps the
consumer bindings around each decision (HOOKS) and broadcasts its result from rank 0
(spectpsync.broadcast). Kept only for those releases (the adapter's ledger): delete this
file with them.
"""

from __future__ import annotations

import functools
import inspect
from dataclasses import replace

import wrapt

from ..engine import census, parallel_groups
from ..engine.contract import KEYWORD_ONLY, POSITIONAL, Contract, Refused
from ..framework.plan import Hook, Plan, check_hook, combine
from ..spectpsync import broadcast as pack
from ..spectpsync.broadcast import DFLASH, DSPARK, SERVED_ELSEWHERE, bind_group, resolve_group, worker_server_args
from ..spectpsync.sites import MEMORY, Site, labels, spans
# The package defines its name and flag before it imports this file.
from . import FLAG, NAME

SPEC = "sglang.srt.speculative"
PACKAGE = f"{SPEC}.dspark_components"
DRAFT = f"{PACKAGE}.dspark_draft"
DRAFT_SAMPLER = f"{PACKAGE}.dspark_draft_sampler"  # 0.5.17+
VERIFY = f"{PACKAGE}.dspark_verify"
DSPARK_WORKER = f"{PACKAGE}.dspark_worker_v2"
DFLASH_WORKER = f"{SPEC}.dflash_worker_v2"
DSPARK_SITES = frozenset({Site.DSPARK_DRAFT, Site.DSPARK_ACCEPT_GREEDY, Site.DSPARK_ACCEPT_SAMPLE,
                          Site.DSPARK_ACCEPT_GRAPH, Site.DSPARK_TARGET})
DFLASH_SITES = frozenset({Site.DFLASH_ACCEPT_SAMPLE, Site.DFLASH_ACCEPT_GREEDY, Site.DFLASH_TARGET})


# ---------------------------------------------------------------- wrappers

def _synced_sampler(sampler):
    def step(step_logits, step_idx):
        tokens = sampler(step_logits, step_idx)
        pack.broadcast(DSPARK, Site.DSPARK_DRAFT, tokens)
        return tokens

    return step


class _SyncedHead(wrapt.ObjectProxy):
    """The markov head as sample_draft_block sees it: sample_block's sampler broadcasts."""

    def sample_block(self, *args, sampler, **kwargs):
        return self.__wrapped__.sample_block(*args, sampler=_synced_sampler(sampler), **kwargs)


def _eager_draft(wrapped, instance, args, kwargs):
    return wrapped(*args, **dict(kwargs, markov_head=_SyncedHead(kwargs["markov_head"])))


def _graph_greedy(wrapped, instance, args, kwargs):
    tokens = wrapped(*args, **kwargs)
    pack.broadcast(DSPARK, Site.DSPARK_DRAFT, tokens)
    return tokens


class _SyncedStepTokens(wrapt.ObjectProxy):
    """Stands for the `SampleStepTokens` class binding: `.execute` broadcasts its result."""

    def execute(self, *args, **kwargs):
        tokens = self.__wrapped__.execute(*args, **kwargs)
        pack.broadcast(DSPARK, Site.DSPARK_DRAFT, tokens)
        return tokens


def _eager_accept(sites, wrapped, instance, args, kwargs):
    # One binding serves two sites: which one this call is depends on the batch.
    triple = wrapped(*args, **kwargs)
    info = kwargs.get("sampling_info")
    site = Site.DSPARK_ACCEPT_GREEDY if info is None or info.is_all_greedy else Site.DSPARK_ACCEPT_SAMPLE
    return pack.broadcast(DSPARK, site, *triple) if site in sites else triple


def _graph_accept(wrapped, instance, args, kwargs):
    return pack.broadcast(DSPARK, Site.DSPARK_ACCEPT_GRAPH, *wrapped(*args, **kwargs))


def _dspark_prefill(wrapped, instance, args, kwargs):
    result = wrapped(*args, **kwargs)
    batch = args[0] if args else kwargs["batch"]
    if batch.forward_mode.is_idle():  # same on every rank of the group
        return result
    ids = result.next_token_ids
    pack.broadcast(DSPARK, Site.DSPARK_TARGET, ids)
    bonus = getattr(result.next_draft_input, "bonus_tokens", None)
    if bonus is not None and bonus is not ids:  # make_next_draft_input may have copied (.to(int64))
        bonus.copy_(ids.view_as(bonus))
    return result


def _dflash_accept_sample(wrapped, instance, args, kwargs):
    return pack.broadcast(DFLASH, Site.DFLASH_ACCEPT_SAMPLE, *wrapped(*args, **kwargs))


_SYNCED_MARK = "_dsv41_rank0_synced"


def _sync_target_predict(key):
    def wrapper(wrapped, instance, args, kwargs):
        predict = kwargs[key] if key in kwargs else inspect.signature(wrapped).bind(*args, **kwargs).arguments[key]
        # The Triton call can fail on one rank only and fall back to the eager one with
        # the same tensor: broadcast it once, so every rank issues the same collectives.
        if not getattr(predict, _SYNCED_MARK, False):
            pack.broadcast(DFLASH, Site.DFLASH_ACCEPT_GREEDY, predict)
            setattr(predict, _SYNCED_MARK, True)
        return wrapped(*args, **kwargs)

    return wrapper


def _dflash_prefill(wrapped, instance, args, kwargs):
    pack.broadcast(DFLASH, Site.DFLASH_TARGET, kwargs["bonus_tokens"])
    return wrapped(*args, **kwargs)


def _recorder(family):
    """Resolve the family's group once, in its worker's __init__, outside the draft context."""
    def wrapper(wrapped, instance, args, kwargs):
        bind_group(family, resolve_group(worker_server_args(args, kwargs)))
        return wrapped(*args, **kwargs)

    return wrapper


# ---------------------------------------------------------------- declaration

K = KEYWORD_ONLY
PROPOSE, FORWARD = ("DraftBlockProposer.propose",), ("DFlashWorkerV2.forward_batch_generation",)
HOOKS = (
    Hook(DRAFT, "sample_draft_block", _eager_draft, {"markov_head": K, "base_logits": K}, PROPOSE,
         tag=frozenset({Site.DSPARK_DRAFT})),
    Hook(DRAFT_SAMPLER, "greedy_step_sampler", _graph_greedy, {"step_logits": POSITIONAL, "step_idx": POSITIONAL},
         ("DsparkDraftSampler.__call__",), tag=frozenset({Site.DSPARK_DRAFT})),
    Hook(DRAFT_SAMPLER, "SampleStepTokens", proxy=_SyncedStepTokens, used_in=("DsparkDraftSampler.__call__",),
         tag=frozenset({Site.DSPARK_DRAFT})),
    Hook(VERIFY, "accept_draft_tokens", _eager_accept, {"candidates": K, "target_logits": K, "sampling_info": K},
         ("TargetVerifyExecutor.accept_and_finalize",), tag=frozenset({Site.DSPARK_ACCEPT_GREEDY, Site.DSPARK_ACCEPT_SAMPLE})),
    Hook(VERIFY, "accept_greedy_triton", _graph_accept, {"candidates": K, "target_logits": K},
         ("DsparkVerifyEpilogue._accept",), tag=frozenset({Site.DSPARK_ACCEPT_GRAPH})),
    Hook(DSPARK_WORKER, "DSparkWorkerV2._forward_prefill", _dspark_prefill, {"self": POSITIONAL, "batch": POSITIONAL},
         tag=frozenset({Site.DSPARK_TARGET})),
    Hook(DSPARK_WORKER, "DSparkWorkerV2.__init__", _recorder(DSPARK), {"self": POSITIONAL, "server_args": POSITIONAL},
         tag=DSPARK_SITES),
    Hook(DFLASH_WORKER, "compute_dflash_sampling_correct_drafts_and_bonus", _dflash_accept_sample,
         {"candidates": K}, FORWARD, tag=frozenset({Site.DFLASH_ACCEPT_SAMPLE})),
    Hook(DFLASH_WORKER, "compute_dflash_correct_drafts_and_bonus", _sync_target_predict("target_predict"),
         {"target_predict": K}, FORWARD, tag=frozenset({Site.DFLASH_ACCEPT_GREEDY})),
    Hook(DFLASH_WORKER, "_compute_dflash_accept_bonus_triton_unchecked", _sync_target_predict("target_top1"),
         {"target_top1": POSITIONAL}, FORWARD, tag=frozenset({Site.DFLASH_ACCEPT_GREEDY})),
    Hook(DFLASH_WORKER, "DFlashWorkerV2._make_next_draft_input_prefill", _dflash_prefill,
         {"bonus_tokens": K, "seq_lens": K}, tag=frozenset({Site.DFLASH_TARGET})),
    Hook(DFLASH_WORKER, "DFlashWorkerV2.__init__", _recorder(DFLASH), {"self": POSITIONAL, "server_args": POSITIONAL},
         tag=DFLASH_SITES),
)
# Where the markov head samples a draft block: its sampler= is what _SyncedHead wraps.
SAMPLE_BLOCK_CALLERS = {DRAFT: ("sample_draft_block",), DRAFT_SAMPLER: ("DsparkDraftSampler.__call__",)}


# ---------------------------------------------------------------- census

# What the census (adapter.engine.census) may find besides a hook's own binding: every reference
# in the engine to a hooked decision function, or to a name that reaches one from below,
# must be at one of these sites (0.5.16-0.5.18, the releases this adapter patches).
C = census
KERNELS_DSPARK = ("sglang.srt.speculative.dspark_components.kernels", "sglang.kernels.ops.speculative.dspark")
DSPARK_ACCEPT = tuple(f"{k}.dspark_accept" for k in KERNELS_DSPARK)
DSPARK_DRAFT_MODEL = tuple(f"{k}.dspark_draft_model" for k in KERNELS_DSPARK)
DFLASH_KERNEL = "sglang.kernels.ops.speculative.dflash"
DFLASH_UTILS = f"{SPEC}.dflash_utils"
OBSERVABILITY = f"{PACKAGE}.dspark_observability"
MARKOV_HEADS = (("sglang.srt.models.dspark", "VanillaMarkov"), ("sglang.srt.models.dspark", "RNNHead"),
                ("sglang.srt.models.deepseek_v4_dspark", "DSparkV4MarkovHead"))
GREEDY_ACCEPT = frozenset({Site.DSPARK_ACCEPT_GREEDY, Site.DSPARK_ACCEPT_SAMPLE})
# Names that reach a hooked decision from below (site tags they serve): the markov head's
# sampler entry point, and the greedy accept implementations under accept_draft_tokens.
REACHING = {"sample_block": frozenset({Site.DSPARK_DRAFT}), "AcceptGreedy": GREEDY_ACCEPT,
            "accept_greedy": GREEDY_ACCEPT}
IMPORTED = (C.IMPORT,)
DEFINED = (C.DEFINITION,)
CENSUS_SITES = (
    # Where the decision functions and the names above them are defined or imported.
    *C.sites(DSPARK_DRAFT_MODEL, "<module>", ["SampleStepTokens"], DEFINED, "definition"),
    *C.sites(DRAFT, "<module>", ["SampleStepTokens"], IMPORTED, "import"),
    *C.sites(DSPARK_ACCEPT, "<module>", ["accept_greedy_triton", "AcceptGreedy", "accept_greedy"], DEFINED, "definition"),
    *C.sites(DSPARK_ACCEPT, "<module>", ["compute_dflash_correct_drafts_and_bonus"], IMPORTED, "import"),
    *C.sites(VERIFY, "<module>", ["accept_greedy_triton", "AcceptGreedy"], IMPORTED, "import"),
    *C.sites(DFLASH_UTILS, "<module>", ["compute_dflash_correct_drafts_and_bonus",
                                        "compute_dflash_sampling_correct_drafts_and_bonus"], DEFINED, "definition"),
    *C.sites(DFLASH_KERNEL, "<module>", ["_compute_dflash_accept_bonus_triton_unchecked"], DEFINED, "definition"),
    *[C.Site(module, cls, frozenset({"sample_block"}), frozenset(DEFINED), "a markov head's sample_block")
      for module, cls in MARKOV_HEADS],
    # Inside sample_draft_block, whose markov head's sampler= the hook wraps.
    *C.sites(DRAFT, "sample_draft_block", ["SampleStepTokens", "sample_block"], (C.NAME, C.ATTRIBUTE),
             "inside the hooked sample_draft_block"),
    *C.sites(DRAFT_SAMPLER, "DsparkDraftSampler.__call__", ["sample_block"], (C.ATTRIBUTE,),
             "sampler= wrapped by the SampleStepTokens/greedy_step_sampler hooks, checked to be passed"),
    *C.sites(DRAFT, "DsparkDraftSampler.__call__", ["sample_block"], (C.ATTRIBUTE,),
             "0.5.16's draft sampler, checked to pass sampler="),
    # Greedy accept implementations, reached only from the hooked accept_draft_tokens /
    # accept_greedy_triton bindings, whose results are broadcast.
    *C.sites(VERIFY, "accept_draft_tokens", ["AcceptGreedy"], (C.NAME,), "inside the hooked accept_draft_tokens"),
    *C.sites(DSPARK_ACCEPT, "AcceptGreedy.triton", ["accept_greedy_triton"], (C.NAME,), "below accept_draft_tokens"),
    *C.sites(DSPARK_ACCEPT, "AcceptGreedy.torch", ["accept_greedy"], (C.NAME,), "below accept_draft_tokens"),
    *C.sites(DSPARK_ACCEPT, ("accept_greedy", "accept_greedy_triton"), ["compute_dflash_correct_drafts_and_bonus"],
             (C.NAME,), "below the hooked DSpark accept"),
    # Metrics only: the result feeds logged per-position metrics and the STS recorder,
    # never the committed tokens.
    *C.sites(OBSERVABILITY, "<module>", ["compute_dflash_correct_drafts_and_bonus"], IMPORTED, "import"),
    *C.sites(OBSERVABILITY, ("ConfidenceMetricsProbe.maybe_observe", "DsparkStepObservers._maybe_record_sts_collect"),
             ["compute_dflash_correct_drafts_and_bonus"], (C.NAME,), "metrics only"),
)


def census_sites(hooks) -> list:
    """The hooks' own bindings (bare-name uses in `used_in`, the module-level import or
    definition) and the reviewed sites above."""
    own = [site for hook in hooks for site in (
        *C.sites(hook.module, hook.used_in, [hook.binding], (C.NAME,), "the hooked binding"),
        *C.sites(hook.module, "<module>", [hook.binding], (C.IMPORT, C.DEFINITION), "the hooked binding's import"))]
    return own + list(CENSUS_SITES)


def _census(engine, sites: frozenset) -> None:
    hooks = [h for h in HOOKS if h.used_in and h.tag & sites]
    names = {h.binding for h in hooks} | {name for name, tags in REACHING.items() if tags & sites}
    census.refuse_unknown(NAME, engine, names, census_sites(hooks),
                          "a decision function whose result would not be broadcast,")


def _sample_block_calls(contract: Contract, functions) -> None:
    contract.only_used_in("sample_block", functions, attribute=True)
    for found in contract.calls("sample_block", method=True):
        if "sampler" not in {k.arg for k in found.node.keywords}:
            raise contract.refuse(found.function, f"line {found.line} no longer passes sampler= to sample_block")


def _module_plan(contract: Contract, sites: frozenset) -> Plan:
    name = contract.module.__name__
    hooks = [h for h in HOOKS if h.module == name and h.tag & sites]
    if not hooks:
        return Plan("not needed", f"no selected site in {name}")
    if name in SAMPLE_BLOCK_CALLERS and Site.DSPARK_DRAFT in sites:
        _sample_block_calls(contract, SAMPLE_BLOCK_CALLERS[name])
    if name == DRAFT_SAMPLER and Site.DSPARK_DRAFT in sites:
        # unwrap: judge the engine's class, not the proxy an earlier decision put there
        execute = getattr(inspect.unwrap(contract.attr("SampleStepTokens")), "execute", None)
        if not callable(execute) or "step_logits" not in inspect.signature(execute).parameters:
            raise contract.refuse("SampleStepTokens.execute", "is gone or no longer takes step_logits")
    patches = []
    for hook in hooks:
        patch = check_hook(contract, hook)
        if hook.wrapper is _eager_accept:
            patch = replace(patch, wrapper=functools.partial(_eager_accept, sites))
        patches.append(patch)
    return Plan("applied", ", ".join(p.where for p in patches), patches)


def plan(engine, modules: dict, sites: frozenset, memory_off: str, memory_left: str) -> Plan:
    """0.5.16 - 0.5.18: the pack's own broadcast at every selected site it serves
    (`memory_off`: what to add where DSV41_GROUP_MIN_MEM serves the memory sites and is off;
    `memory_left`: the same for the short reason)."""
    patchable = sites - SERVED_ELSEWHERE.keys()
    uncovered = sites & MEMORY
    note = "" if not uncovered else \
        f"; sites {labels(uncovered)} are served by DSV41_GROUP_MIN_MEM on this release{memory_off}"
    if not patchable:
        served = "; ".join(f"{s.label} by {SERVED_ELSEWHERE[s]}" for s in sorted(sites))
        raise Refused(NAME, FLAG, f"selects no site this adapter broadcasts on this release ({served}): "
                                  f"unset {FLAG} and use the flag named for each site", engine.version)
    if Site.DSPARK_DRAFT in sites and DRAFT_SAMPLER not in modules:
        raise Refused(NAME, DRAFT_SAMPLER, "is missing: the graph-folded draft path is not covered "
                                           "(drop dspark-draft from the flag, e.g. all,-dspark-draft)", engine.version)
    plans = [_module_plan(Contract(NAME, module), patchable) for name, module in modules.items()]
    plan = combine(NAME, engine.version, plans)
    _census(engine, patchable)
    groups = parallel_groups.check(NAME, engine)  # what resolve_group reads at each worker's __init__
    plan.detail = f"rank-0 broadcast at {labels(patchable)} via {plan.detail}{note}; the groups: {groups}"
    plan.short_reason = (f"the pack broadcasts sites {spans(patchable)} from rank 0 (the engine has no SpecTpSync)"
                         + (memory_left if uncovered else ""))
    return plan
