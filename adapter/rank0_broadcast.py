"""Rank-0 broadcast per decision site (DSV41_SPEC_TP_SYNC).

Each TP rank takes DSpark / DFlash speculative decisions on its own (draft tokens,
accept triple, prefill tokens, DFlash accept); when one rank decides differently the
ranks commit different token counts and the next collective hangs. Upstream 0.5.19
added `SpecTpSync`, which broadcasts every such decision from rank 0 before any
state derives from it. This adapter does the same on 0.5.16 - 0.5.18 by replacing
the consumer bindings around each decision, and on 0.5.19+ hands the flag over to
the engine's own `SGLANG_SPEC_TP_SYNC` (superseded).

Flag grammar = upstream 0.5.22's `parse_spec_tp_sync`: comma list of presets
(all/off/none/init/rng), site slugs and numbers, each negatable with a leading "-";
"_" reads as "-", spaces and case are ignored; the retired draft handles 2-6 and
their slugs select DSPARK_DRAFT (17). Unset = off. An unknown token is a FlagError.

Which sites `check`/`install` act on: the selection of the last `parse()` call in
this process (runtime.decide calls parse then install), else `parse(os.environ)`.

The memory-probe sites (1 dspark-mem, 12 dflash-mem) are accepted by the parser
but not patched here: on 0.5.16 - 0.5.18 they are served by DSV41_GROUP_MIN_MEM.
The verify plan (7 dspark-plan) is already broadcast by 0.5.16 - 0.5.18 itself.
"""

from __future__ import annotations

import ast
import collections
import importlib.util
import inspect
import logging
import os
import pathlib
from collections.abc import Mapping
from enum import IntEnum

from . import patching
from .contract import KEYWORD_ONLY, POSITIONAL, Contract, Patch, Plan, calls, find, from_source, has_module
from .flags import FlagError

logger = logging.getLogger(__name__)

NAME = "rank0_broadcast"
FLAG = "DSV41_SPEC_TP_SYNC"
ENGINE_FLAG = "SGLANG_SPEC_TP_SYNC"
SUMMARY = "broadcast every DSpark/DFlash speculative decision from TP rank 0 (upstream SpecTpSync grammar)"
# The flag value doctor and the compatibility matrix check the engine with.
CHECK_VALUE = "all"

SPEC = "sglang.srt.speculative"
PACKAGE = f"{SPEC}.dspark_components"
SPEC_TP_SYNC = f"{SPEC}.spec_tp_sync"
DRAFT = f"{PACKAGE}.dspark_draft"
DRAFT_SAMPLER = f"{PACKAGE}.dspark_draft_sampler"
VERIFY = f"{PACKAGE}.dspark_verify"
DSPARK_WORKER = f"{PACKAGE}.dspark_worker_v2"
DFLASH_WORKER = f"{SPEC}.dflash_worker_v2"
# (module, required). spec_tp_sync exists from 0.5.19 (superseded); the draft sampler
# module from 0.5.17 (0.5.16 folds the draft elsewhere: refused if the draft site is on).
TARGETS = (
    (SPEC_TP_SYNC, False),
    (DRAFT, True),
    (DRAFT_SAMPLER, False),
    (VERIFY, True),
    (DSPARK_WORKER, True),
    (DFLASH_WORKER, True),
)


class Site(IntEnum):
    """Upstream 0.5.22+ numbering (SpecTpSyncSite)."""

    DSPARK_MEM = 1
    DSPARK_PLAN = 7
    DSPARK_ACCEPT_GREEDY = 8
    DSPARK_ACCEPT_SAMPLE = 9
    DSPARK_ACCEPT_GRAPH = 10
    DSPARK_TARGET = 11
    DSPARK_DRAFT = 17
    DFLASH_MEM = 12
    DFLASH_SELECTOR = 13
    DFLASH_ACCEPT_SAMPLE = 14
    DFLASH_ACCEPT_GREEDY = 15
    DFLASH_TARGET = 16

    @property
    def slug(self) -> str:
        return self.name.lower().replace("_", "-")


ALL = frozenset(Site)
_INIT = frozenset({Site.DSPARK_MEM, Site.DFLASH_MEM})
_RNG = frozenset({Site.DSPARK_ACCEPT_SAMPLE, Site.DSPARK_TARGET, Site.DFLASH_SELECTOR,
                  Site.DFLASH_ACCEPT_SAMPLE, Site.DFLASH_TARGET})
PRESETS = {"all": ALL, "off": frozenset(), "none": frozenset(), "init": _INIT, "rng": _INIT | _RNG}
_BY_SLUG = {s.slug: s for s in Site}
_BY_NUMBER = {str(int(s)): s for s in Site}
RETIRED = {t: Site.DSPARK_DRAFT for t in (
    "dspark-draft-greedy", "dspark-draft-sample", "dspark-draft-multinomial",
    "dspark-graph-sample", "dspark-graph-greedy", "2", "3", "4", "5", "6")}
# Parsed but served elsewhere on 0.5.16-0.5.18 (see module docstring).
NOT_PATCHED_HERE = {Site.DSPARK_MEM: "DSV41_GROUP_MIN_MEM", Site.DFLASH_MEM: "DSV41_GROUP_MIN_MEM",
                    Site.DSPARK_PLAN: "the engine (dspark_planner broadcasts verify_lens itself)",
                    Site.DFLASH_SELECTOR: "nothing (no DFlash selector before 0.5.19)"}


def _accepted_forms() -> str:
    return (f"comma-separated presets {sorted(PRESETS)}, site slugs or numbers "
            f"{[f'{int(s)}:{s.slug}' for s in sorted(Site)]}, retired draft handles 2-6, "
            f"each optionally negated with a leading '-'")


def _resolve(name: str, raw: str) -> frozenset:
    if name in PRESETS:
        return PRESETS[name]
    if name in RETIRED:
        logger.warning("%s token %r is retired; it selects %r.", FLAG, name, RETIRED[name].slug)
        return frozenset({RETIRED[name]})
    site = _BY_SLUG.get(name) or _BY_NUMBER.get(name)
    if site is None:
        raise FlagError(f"{FLAG}={raw!r}: unknown token {name!r}; accepted: {_accepted_forms()}; "
                        f"or leave {FLAG} unset for off")
    return frozenset({site})


def parse_value(raw: str) -> frozenset:
    """Upstream's parse_spec_tp_sync, token for token (FlagError instead of ValueError)."""
    sites: frozenset = frozenset()
    for token in raw.replace(" ", "").replace("_", "-").lower().split(","):
        if not token:
            continue
        negate = token.startswith("-")
        value = _resolve(token[1:] if negate else token, raw)
        sites = sites - value if negate else sites | value
    return sites


class Selection(frozenset):
    """The selected sites. Truthy when a site is selected, and also when the flag is set
    to an empty selection (e.g. "off") on an engine with its own SpecTpSync, so that the
    value is still handed over to SGLANG_SPEC_TP_SYNC there."""

    handover = False

    def __bool__(self) -> bool:
        return bool(len(self)) or self.handover


_state: dict = {}


def _engine_has_spec_tp_sync() -> bool:
    """Whether the installed engine carries spec_tp_sync.py, found without importing sglang."""
    try:
        spec = importlib.util.find_spec("sglang")
    except (ImportError, ValueError):
        return False
    if spec is None or not spec.submodule_search_locations:
        return False
    return any((pathlib.Path(p) / "srt" / "speculative" / "spec_tp_sync.py").is_file()
               for p in spec.submodule_search_locations)


def parse(environ: Mapping[str, str] = os.environ) -> Selection:
    raw = environ.get(FLAG)
    sites = Selection(parse_value(raw)) if raw is not None else Selection()
    sites.handover = raw is not None and _engine_has_spec_tp_sync()
    _state.update(environ=environ, sites=sites)
    return sites


def selected() -> Selection:
    if "sites" not in _state:
        parse(os.environ)
    return _state["sites"]


# ---------------------------------------------------------------------------
# Broadcast machinery (0.5.16 - 0.5.18)

DSPARK, DFLASH = "dspark", "dflash"
_groups: dict = {}
# Collectives issued per site since the last reset (counted in Python: a site inside
# a captured graph counts once per capture, then replays without Python).
COUNTS: collections.Counter = collections.Counter()
_INTS = None


def bind_group(family: str, group) -> None:
    """Record the group a family's sites broadcast over (a GroupCoordinator-like object
    with .broadcast(t, src=0), .world_size, .rank_in_group)."""
    _groups[family] = group


def _group(family: str):
    group = _groups.get(family)
    if group is None:
        raise RuntimeError(f"{NAME}: no TP group recorded for {family} (its worker __init__ did not run "
                           f"through the adapter); refusing to decide per rank")
    return group


def _int_dtypes():
    global _INTS
    if _INTS is None:
        import torch

        _INTS = {torch.int8, torch.uint8, torch.int16, torch.int32, torch.int64}
    return _INTS


def _bcast_one(group, tensor) -> None:
    if tensor.is_contiguous():
        group.broadcast(tensor, src=0)
    else:
        tmp = tensor.contiguous()
        group.broadcast(tmp, src=0)
        tensor.copy_(tmp)


def broadcast(family: str, site: Site, *tensors) -> None:
    """Overwrite each tensor in place with rank 0's value: one collective when the
    tensors are integer vectors of one shape and device (packed as int64 [n, bs]),
    else one per tensor."""
    group = _group(family)
    if group.world_size == 1:
        return
    import torch

    first = tensors[0]
    packable = len(tensors) > 1 and all(
        t.dtype in _int_dtypes() and t.dim() == 1 and t.shape == first.shape and t.device == first.device
        for t in tensors)
    if packable:
        packed = torch.stack([t.to(torch.int64) for t in tensors])
        group.broadcast(packed, src=0)
        for t, row in zip(tensors, packed):
            t.copy_(row)
        COUNTS[site.slug] += 1
        return
    for t in tensors:
        _bcast_one(group, t)
        COUNTS[site.slug] += 1


# --- DSpark draft: per step, eager (sampler closure) and graph-folded (module bindings)

def _synced_sampler(sampler):
    def step(step_logits, step_idx):
        tokens = sampler(step_logits, step_idx)
        broadcast(DSPARK, Site.DSPARK_DRAFT, tokens)
        return tokens

    return step


class _SyncedHead:
    """The markov head as sample_draft_block sees it: sample_block's sampler broadcasts."""

    def __init__(self, head):
        self._head = head

    def sample_block(self, *args, sampler, **kwargs):
        return self._head.sample_block(*args, sampler=_synced_sampler(sampler), **kwargs)

    def __getattr__(self, name):
        return getattr(self._head, name)


def _eager_draft(wrapped, instance, args, kwargs):
    kwargs = dict(kwargs, markov_head=_SyncedHead(kwargs["markov_head"]))
    return wrapped(*args, **kwargs)


def _graph_greedy(wrapped, instance, args, kwargs):
    tokens = wrapped(*args, **kwargs)
    broadcast(DSPARK, Site.DSPARK_DRAFT, tokens)
    return tokens


class _SyncedStepTokens(patching.AdapterWrapper):
    """Stands for the `SampleStepTokens` class binding: `.execute` broadcasts its result."""

    def execute(self, *args, **kwargs):
        tokens = self.__wrapped__.execute(*args, **kwargs)
        broadcast(DSPARK, Site.DSPARK_DRAFT, tokens)
        return tokens


def _passthrough(wrapped, instance, args, kwargs):
    return wrapped(*args, **kwargs)


# --- DSpark accept triple (eager and captured), prefill tokens

def _eager_accept(wrapped, instance, args, kwargs):
    triple = wrapped(*args, **kwargs)
    info = kwargs.get("sampling_info")
    site = Site.DSPARK_ACCEPT_GREEDY if info is None or info.is_all_greedy else Site.DSPARK_ACCEPT_SAMPLE
    if site in selected():
        broadcast(DSPARK, site, *triple)
    return triple


def _graph_accept(wrapped, instance, args, kwargs):
    triple = wrapped(*args, **kwargs)
    broadcast(DSPARK, Site.DSPARK_ACCEPT_GRAPH, *triple)
    return triple


def _dspark_prefill(wrapped, instance, args, kwargs):
    result = wrapped(*args, **kwargs)
    batch = args[0] if args else kwargs["batch"]
    if batch.forward_mode.is_idle():  # same on every rank of the group
        return result
    ids = result.next_token_ids
    broadcast(DSPARK, Site.DSPARK_TARGET, ids)
    bonus = getattr(result.next_draft_input, "bonus_tokens", None)
    if bonus is not None and bonus is not ids:  # make_next_draft_input may have copied (.to(int64))
        bonus.copy_(ids.view_as(bonus))
    return result


# --- DFlash

def _dflash_accept_sample(wrapped, instance, args, kwargs):
    accept_len, bonus = wrapped(*args, **kwargs)
    broadcast(DFLASH, Site.DFLASH_ACCEPT_SAMPLE, accept_len, bonus)
    return accept_len, bonus


_SYNCED_MARK = "_dsv41_rank0_synced"


def _sync_target_predict(key):
    def wrapper(wrapped, instance, args, kwargs):
        if key in kwargs:  # the engine's call sites pass it by keyword
            predict = kwargs[key]
        else:
            predict = inspect.signature(wrapped).bind(*args, **kwargs).arguments[key]
        # The Triton call can fail on one rank only and fall back to the eager one with
        # the same tensor: broadcast it once, so every rank issues the same collectives.
        if not getattr(predict, _SYNCED_MARK, False):
            broadcast(DFLASH, Site.DFLASH_ACCEPT_GREEDY, predict)
            setattr(predict, _SYNCED_MARK, True)
        return wrapped(*args, **kwargs)

    return wrapper


def _dflash_prefill(wrapped, instance, args, kwargs):
    broadcast(DFLASH, Site.DFLASH_TARGET, kwargs["bonus_tokens"])
    return wrapped(*args, **kwargs)


# --- group: resolved once, in the worker's __init__, outside the draft context

def resolve_group():
    """Upstream's rule: the attention-TP group under DP attention, else the TP group."""
    from sglang.srt.runtime_context import get_parallel

    parallel = get_parallel()
    return parallel.attn_tp_group if parallel.enable_dp_attention else parallel.tp_group


def _recorder(family):
    def wrapper(wrapped, instance, args, kwargs):
        bind_group(family, resolve_group())
        return wrapped(*args, **kwargs)

    return wrapper


# ---------------------------------------------------------------------------
# Contract

def name_uses(source: str, names) -> list[tuple[str, int, str]]:
    """(enclosing function, line, name) for every load of a bare name in `names`."""
    names = frozenset(names)
    found = find(ast.parse(source), lambda n: isinstance(n, ast.Name) and n.id in names and isinstance(n.ctx, ast.Load))
    return [(f.function, f.line, f.node.id) for f in found]


def _only_used_in(contract: Contract, source: str, name: str, functions: set):
    """`name` is used only inside `functions` (and at least once): a use elsewhere would be
    a decision path the adapter does not cover. (No source: nothing to check.)"""
    if not source:
        return
    uses = [u for u in name_uses(source, {name}) if u[0] != "<module>"]
    if not uses:
        raise contract.refuse(name, f"no longer used in {sorted(functions)}; the site moved")
    for function, line, _ in uses:
        if not _within(function, functions):
            raise contract.refuse(f"{function}", f"line {line} uses {name}, a path this adapter does not cover")


def _markov_calls(contract: Contract, source: str, functions: set):
    if not source:
        return
    hits = [(f.function, f.line, {k.arg for k in f.node.keywords})
            for f in calls(ast.parse(source), "sample_block", method=True)]
    for function, line, keywords in hits:
        if not _within(function, functions):
            raise contract.refuse(function, f"line {line} samples a draft block on a path this adapter does not cover")
        if "sampler" not in keywords:
            raise contract.refuse(function, f"line {line} no longer passes sampler= to sample_block")
    if not hits:
        raise contract.refuse(next(iter(functions)), "no longer calls markov_head.sample_block")


def _handover(contract: Contract, module, sites: frozenset) -> tuple[str, str]:
    """(value for SGLANG_SPEC_TP_SYNC, detail) for the engine's own SpecTpSync."""
    contract.attr("SpecTpSync")
    engine_parse = contract.params("parse_spec_tp_sync", {"spec": POSITIONAL})
    site_enum = contract.attr("SpecTpSyncSite")
    if from_source(module):  # read from source, the members are their literal numbers
        engine_sites = {k: v for k, v in vars(site_enum).items() if k.isupper() and isinstance(v, int)}
    else:
        engine_sites = {s.name: s for s in site_enum}
    mapped = set()
    for site in sites:
        if site.name in engine_sites:
            mapped.add(engine_sites[site.name])
        elif site is Site.DSPARK_DRAFT:  # 0.5.19 - 0.5.21: the per-path draft sites 2-6
            per_path = [s for n, s in engine_sites.items() if n.startswith(("DSPARK_DRAFT_", "DSPARK_GRAPH_"))]
            if not per_path:
                raise contract.refuse("SpecTpSyncSite", "has neither DSPARK_DRAFT nor the per-path draft sites")
            mapped.update(per_path)
        else:
            raise contract.refuse("SpecTpSyncSite", f"has no site {site.name}, selected by {FLAG}")
    value = ",".join(str(int(s)) for s in sorted(mapped)) or "off"
    environ = _state.get("environ", os.environ)
    theirs = environ.get(ENGINE_FLAG)
    if theirs is not None:
        if from_source(module):
            raise contract.refuse(ENGINE_FLAG, "is set; comparing it needs the engine's own parser: run doctor on the installed engine")
        try:
            their_sites = engine_parse(theirs)
        except ValueError as exc:
            raise contract.refuse(ENGINE_FLAG, f"the engine cannot parse {theirs!r}: {exc}")
        if {int(s) for s in their_sites} != {int(s) for s in mapped}:
            raise contract.refuse(
                ENGINE_FLAG,
                f"{ENGINE_FLAG}={theirs!r} selects {sorted(int(s) for s in their_sites)} but "
                f"{FLAG}={environ.get(FLAG)!r} selects {sorted(int(s) for s in mapped)}; set one of them "
                f"or make them agree")
        value = None  # already set, and equivalent
    return value, f"{module.__name__}.SpecTpSync broadcasts these decisions itself; {FLAG} handed to {ENGINE_FLAG}"


# What each target module patches, per selected site: (site, owner path, attr, wrapper).
def _patches(module, contract: Contract) -> list[tuple[Site, Patch]]:
    key = module.__name__
    out: list[tuple[Site, Patch]] = []
    if key == DRAFT:
        contract.params("sample_draft_block", {"markov_head": KEYWORD_ONLY, "base_logits": KEYWORD_ONLY})
        src = contract.source()
        _markov_calls(contract, src, {"sample_draft_block"})
        _only_used_in(contract, src, "sample_draft_block", {"DraftBlockProposer.propose"})
        out.append((Site.DSPARK_DRAFT, Patch(module, "sample_draft_block", _eager_draft)))
    elif key == DRAFT_SAMPLER:
        contract.params("DsparkDraftSampler.__call__", {"self": POSITIONAL, "hidden_states": POSITIONAL})
        contract.params("greedy_step_sampler", {"step_logits": POSITIONAL, "step_idx": POSITIONAL})
        step_tokens = contract.attr("SampleStepTokens")
        if isinstance(step_tokens, patching.AdapterWrapper):  # our own proxy: check the class under it
            step_tokens = step_tokens.__wrapped__
        execute = getattr(step_tokens, "execute", None)
        if not callable(execute) or "step_logits" not in inspect.signature(execute).parameters:
            raise contract.refuse("SampleStepTokens.execute", "is gone or no longer takes step_logits")
        src = contract.source()
        _markov_calls(contract, src, {"DsparkDraftSampler.__call__"})
        for name in ("greedy_step_sampler", "SampleStepTokens"):
            _only_used_in(contract, src, name, {"DsparkDraftSampler.__call__"})
        out.append((Site.DSPARK_DRAFT, Patch(module, "greedy_step_sampler", _graph_greedy)))
        out.append((Site.DSPARK_DRAFT, Patch(module, "SampleStepTokens", _passthrough)))
    elif key == VERIFY:
        params = {n: KEYWORD_ONLY for n in ("candidates", "target_logits", "sampling_info")}
        contract.params("accept_draft_tokens", params)
        contract.params("accept_greedy_triton", {"candidates": KEYWORD_ONLY, "target_logits": KEYWORD_ONLY})
        src = contract.source()
        _only_used_in(contract, src, "accept_draft_tokens", {"TargetVerifyExecutor.accept_and_finalize"})
        _only_used_in(contract, src, "accept_greedy_triton", {"DsparkVerifyEpilogue._accept"})
        eager = Patch(module, "accept_draft_tokens", _eager_accept)
        out.append((Site.DSPARK_ACCEPT_GREEDY, eager))
        out.append((Site.DSPARK_ACCEPT_SAMPLE, eager))
        out.append((Site.DSPARK_ACCEPT_GRAPH, Patch(module, "accept_greedy_triton", _graph_accept)))
    elif key == DSPARK_WORKER:
        cls = contract.attr("DSparkWorkerV2")
        contract.params("DSparkWorkerV2._forward_prefill", {"self": POSITIONAL, "batch": POSITIONAL})
        contract.params("DSparkWorkerV2.__init__", {"self": POSITIONAL})
        out.append((Site.DSPARK_TARGET, Patch(cls, "_forward_prefill", _dspark_prefill)))
        dspark = {Site.DSPARK_DRAFT, Site.DSPARK_ACCEPT_GREEDY, Site.DSPARK_ACCEPT_SAMPLE,
                  Site.DSPARK_ACCEPT_GRAPH, Site.DSPARK_TARGET}
        for site in dspark:
            out.append((site, Patch(cls, "__init__", _recorder(DSPARK))))
    elif key == DFLASH_WORKER:
        cls = contract.attr("DFlashWorkerV2")
        contract.params("DFlashWorkerV2.__init__", {"self": POSITIONAL})
        contract.params("DFlashWorkerV2._make_next_draft_input_prefill",
                        {"bonus_tokens": KEYWORD_ONLY, "seq_lens": KEYWORD_ONLY})
        contract.params("compute_dflash_sampling_correct_drafts_and_bonus", {"candidates": KEYWORD_ONLY})
        contract.params("compute_dflash_correct_drafts_and_bonus", {"target_predict": KEYWORD_ONLY})
        contract.params("_compute_dflash_accept_bonus_triton_unchecked", {"target_top1": POSITIONAL})
        src = contract.source()
        forward = {"DFlashWorkerV2.forward_batch_generation"}
        for name in ("compute_dflash_sampling_correct_drafts_and_bonus", "compute_dflash_correct_drafts_and_bonus",
                     "_compute_dflash_accept_bonus_triton_unchecked"):
            _only_used_in(contract, src, name, forward)
        out.append((Site.DFLASH_ACCEPT_SAMPLE,
                    Patch(module, "compute_dflash_sampling_correct_drafts_and_bonus", _dflash_accept_sample)))
        out.append((Site.DFLASH_ACCEPT_GREEDY, Patch(module, "compute_dflash_correct_drafts_and_bonus",
                                                     _sync_target_predict("target_predict"))))
        out.append((Site.DFLASH_ACCEPT_GREEDY, Patch(module, "_compute_dflash_accept_bonus_triton_unchecked",
                                                     _sync_target_predict("target_top1"))))
        out.append((Site.DFLASH_TARGET, Patch(cls, "_make_next_draft_input_prefill", _dflash_prefill)))
        for site in (Site.DFLASH_ACCEPT_SAMPLE, Site.DFLASH_ACCEPT_GREEDY, Site.DFLASH_TARGET):
            out.append((site, Patch(cls, "__init__", _recorder(DFLASH))))
    else:
        raise contract.refuse("<module>", f"not a module this adapter patches ({', '.join(m for m, _ in TARGETS)})")
    return out


# The sites each target module serves (the workers also record the group for them).
_DSPARK_SITES = frozenset({Site.DSPARK_DRAFT, Site.DSPARK_ACCEPT_GREEDY, Site.DSPARK_ACCEPT_SAMPLE,
                           Site.DSPARK_ACCEPT_GRAPH, Site.DSPARK_TARGET})
MODULE_SITES = {
    DRAFT: frozenset({Site.DSPARK_DRAFT}),
    DRAFT_SAMPLER: frozenset({Site.DSPARK_DRAFT}),
    VERIFY: frozenset({Site.DSPARK_ACCEPT_GREEDY, Site.DSPARK_ACCEPT_SAMPLE, Site.DSPARK_ACCEPT_GRAPH}),
    DSPARK_WORKER: _DSPARK_SITES,
    DFLASH_WORKER: frozenset({Site.DFLASH_ACCEPT_SAMPLE, Site.DFLASH_ACCEPT_GREEDY, Site.DFLASH_TARGET}),
}


def _all_patches(module) -> list[tuple[Site, Patch]]:
    """Every patch the module could take (for uninstall), without the contract checks."""
    return _patches(module, _Unchecked(module))


class _Unchecked(Contract):
    """A contract that checks nothing: uninstall only needs the owners and names."""

    def __init__(self, module):
        super().__init__(NAME, module)

    def params(self, dotted, required):
        return None

    def source(self):
        return ""


def _within(function: str, functions: set) -> bool:
    return any(function == f or function.startswith(f + ".") for f in functions)


def check(module) -> Plan:
    """Check the contract in `module` for the selected sites; patches nothing."""
    sites = selected()
    contract = Contract(NAME, module)
    if module.__name__ == SPEC_TP_SYNC:
        value, detail = _handover(contract, module, sites)
        plan = Plan("superseded", detail + (f"={value!r}" if value else " (already set, same sites)"))
        plan.handover = value
        return plan
    if has_module(module, SPEC_TP_SYNC):
        return Plan("not needed", f"{SPEC_TP_SYNC}.SpecTpSync covers {module.__name__}")
    relevant = MODULE_SITES.get(module.__name__)
    if relevant is not None and not relevant & sites:  # nothing selected here: no contract to hold
        return Plan("not needed", f"no selected site in {module.__name__}")
    if module.__name__ == DRAFT and Site.DSPARK_DRAFT in sites:
        if not has_module(module, DRAFT_SAMPLER):
            raise contract.refuse(DRAFT_SAMPLER, "is missing: the graph-folded draft path is not covered "
                                                  "(drop dspark-draft from the flag, or fold no draft)")
    chosen = [(s, p) for s, p in _patches(module, contract) if s in sites]
    patches, seen = [], set()
    for _, patch in chosen:
        key = (id(patch.owner), patch.name)
        if key not in seen:
            seen.add(key)
            patches.append(patch)
    if not patches:
        return Plan("not needed", f"no selected site in {module.__name__}")
    names = ", ".join(f"{getattr(p.owner, '__name__', p.owner)}.{p.name}" for p in patches)
    slugs = ", ".join(s.slug for s in sorted({s for s, _ in chosen}))
    return Plan("applied", f"rank-0 broadcast at {slugs} via {names}", patches)


def _apply(patch: Patch) -> None:
    if patch.wrapper is _passthrough:  # the SampleStepTokens class binding
        if patching.wrapped_by(patch.owner, patch.name) != NAME:
            setattr(patch.owner, patch.name, _SyncedStepTokens(vars(patch.owner)[patch.name], _passthrough, NAME))
        return
    patching.apply(patch, NAME)


def install(module) -> Plan:
    """Apply the selected sites' patches and remove those of unselected sites, so the
    module matches the current flag. On a superseded engine, set SGLANG_SPEC_TP_SYNC."""
    plan = check(module)
    if plan.state == "superseded":
        value = getattr(plan, "handover", None)
        if value is not None:
            _state.setdefault("env_before", os.environ.get(ENGINE_FLAG))
            os.environ[ENGINE_FLAG] = value
        return plan
    if plan.state == "not needed" and has_module(module, SPEC_TP_SYNC):
        return plan
    wanted = {(id(p.owner), p.name) for p in plan.patches}
    for _, patch in _all_patches(module):
        if (id(patch.owner), patch.name) not in wanted:
            patching.remove(patch.owner, patch.name, NAME)
    for patch in plan.patches:
        _apply(patch)
    return plan


def uninstall(module) -> None:
    if module.__name__ == SPEC_TP_SYNC:
        if "env_before" in _state:
            before = _state.pop("env_before")
            if before is None:
                os.environ.pop(ENGINE_FLAG, None)
            else:
                os.environ[ENGINE_FLAG] = before
        return
    try:
        patches = _all_patches(module)
    except Exception:  # a module the adapter never patched
        return
    for _, patch in patches:
        patching.remove(patch.owner, patch.name, NAME)
