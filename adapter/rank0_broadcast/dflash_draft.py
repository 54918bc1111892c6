"""The pack's own site 31:pack-dflash-draft-greedy: DFlash's greedy draft proposal, broadcast
from rank 0 where the ranks can propose different blocks (upstream PR sgl-project/sglang#40246,
open, in no release up to 0.5.23). The verify that follows broadcasts only accept lengths and
bonus tokens (DFLASH_SELECTOR / DFLASH_ACCEPT_*), applied to each rank's own block, so a
block that differs commits different tokens on different ranks.

What each proposal path does under TP, read from the sources of 0.5.16 - 0.5.23 (every
`draft_next = ...` in DFlashWorkerV2.forward_batch_generation comes from one of them; the
check refuses a release where another producer appears):

- plain head, captured (`_DflashDraftSampler.__call__`, 0.5.16+; built only on a head with
  `shard_indices` at TP > 1): each rank takes (max, id) of its own vocab shard, both are
  all-gathered, and every rank argmaxes the same gathered table. The ranks cannot disagree
  (ENGINE_NOTES 2.2 holds for this path): no broadcast; refused where it no longer gathers.
- plain head, eager (`DFlashWorkerV2._greedy_sample_from_vocab_parallel_head`, 0.5.16+): the
  same gather on a head with `shard_indices`, TP-safe; on a head without them each rank
  argmaxes logits it computed itself: rank-local. Broadcast only there.
- selector lattice (0.5.19+; captured `_SelectorDraftSampler.__call__`, eager
  `DFlashWorkerV2._propose_selector_block`): candidates are gathered, but the lattice scores
  come from tables replicated on every rank and each rank walks its own argmax path:
  rank-local for every greedy row, in an all-greedy batch or a mixed one. The block is
  broadcast whole (a mixed batch's sampled rows come along, so every rank verifies rank 0's
  block; their accept is DFLASH_SELECTOR's, 13).
- Domino rollout (0.5.20+; `domino_greedy_rollout`, called by `_DominoDraftSampler.__call__`
  inside the draft graph and by forward_batch_generation eagerly): the first proposal is
  gathered (TP-safe); each later one is argmax(base + correction), the correction from the
  draft's replicated projector and GRU, computed per rank: rank-local. Broadcast the block.
- LiLiCorr (0.5.21+; captured `LiLiCorrDraftSampler.__call__`, eager `propose_lilicorr_block`):
  not named by the PR; the same shape as the selector (a replicated head choosing among
  gathered candidates): rank-local. Broadcast the block.

Captured samplers broadcast inside the draft graph (recorded at capture, as upstream's
DSpark draft sites are); eager paths broadcast the block they return. The broadcast is the
pack's (spectpsync.broadcast), on every release: over the group DFlashWorkerV2.__init__
resolves on 0.5.16 - 0.5.18, and on 0.5.19+ over the group the worker built its own
SpecTpSync over, beside the engine's sites, which it does not touch.
"""

from __future__ import annotations

import ast
import functools
import textwrap
from typing import Optional

from ..engine import parallel_groups, syntax
from ..engine.contract import KEYWORD_ONLY, POSITIONAL, Contract, target_modules
from ..framework.plan import Hook, Patch, Plan, check_hook
from ..spectpsync import broadcast as pack
from ..spectpsync.broadcast import DFLASH, bind_group, resolve_group, worker_server_args
from ..spectpsync.sites import Site
from . import NAME

SITE = Site.PACK_DFLASH_DRAFT_GREEDY
SPEC = "sglang.srt.speculative"
WORKER = f"{SPEC}.dflash_worker_v2"
LILICORR = f"{SPEC}.lilicorr_utils"  # 0.5.21+
FORWARD = "DFlashWorkerV2.forward_batch_generation"
INIT = "DFlashWorkerV2.__init__"


# ---------------------------------------------------------------- wrappers

def _captured_block(wrapped, instance, args, kwargs):
    """Around a draft sampler's __call__(hidden_states, input_ids): the block it wrote to
    self.out, bs * (block_size - 1) tokens, broadcast in place (inside the draft graph)."""
    result = wrapped(*args, **kwargs)
    hidden = args[0] if args else kwargs["hidden_states"]
    rows = hidden.shape[0] // instance.block_size * (instance.block_size - 1)
    pack.broadcast(DFLASH, SITE, instance.out[:rows])
    return result


def _returned_block(wrapped, instance, args, kwargs):
    block = wrapped(*args, **kwargs)
    pack.broadcast(DFLASH, SITE, block)
    return block


def _returned_first(wrapped, instance, args, kwargs):
    """propose_lilicorr_block returns (tokens, candidate ids, q rows): the tokens are the block."""
    result = wrapped(*args, **kwargs)
    pack.broadcast(DFLASH, SITE, result[0])
    return result


def _plain_head(wrapped, instance, args, kwargs):
    # Same test as the engine's branch: a head without shard_indices is argmaxed per rank.
    block = wrapped(*args, **kwargs)
    if not hasattr(kwargs["lm_head"], "shard_indices"):
        pack.broadcast(DFLASH, SITE, block)
    return block


def _record_group(wrapped, instance, args, kwargs):
    """0.5.16 - 0.5.18: resolve the DFlash group once, in the worker's __init__, outside the
    draft context (upstream's rule, as the pack's other DFlash sites there)."""
    bind_group(DFLASH, resolve_group(worker_server_args(args, kwargs)))
    return wrapped(*args, **kwargs)


def _engine_group(wrapped, instance, args, kwargs):
    """0.5.19+: the group the worker built its own SpecTpSync over (the group that runs one
    batch, shown by groups_proof.worker_groups), kept once __init__ has run; nothing proposes
    a draft before it returns (capture and the selector warm-up run in init_cuda_graphs)."""
    result = wrapped(*args, **kwargs)
    bind_group(DFLASH, instance._tp_sync._tp_group)
    return result


# ---------------------------------------------------------------- declaration

K, P = KEYWORD_ONLY, POSITIONAL
SAMPLER_PARAMS = {"self": P, "hidden_states": P, "input_ids": P}
TAG = frozenset({SITE})
RECORDER = Hook(WORKER, INIT, _record_group, {"self": P, "server_args": P}, tag=TAG)
ENGINE_GROUP = Hook(WORKER, INIT, _engine_group, {"self": P}, tag=TAG)
PLAIN = Hook(WORKER, "DFlashWorkerV2._greedy_sample_from_vocab_parallel_head", _plain_head,
             {"hidden_states": K, "lm_head": K}, tag=TAG)
SELECTOR = (Hook(WORKER, "_SelectorDraftSampler.__call__", _captured_block, SAMPLER_PARAMS, tag=TAG),
            Hook(WORKER, "DFlashWorkerV2._propose_selector_block", _returned_block, {"bs": K, "lm_head": K}, tag=TAG))
DOMINO = (Hook(WORKER, "domino_greedy_rollout", _returned_block, {"draft_hidden": K},
               ("_DominoDraftSampler.__call__", FORWARD), tag=TAG),)
LILI = (Hook(LILICORR, "LiLiCorrDraftSampler.__call__", _captured_block, SAMPLER_PARAMS, tag=TAG),
        Hook(WORKER, "propose_lilicorr_block", _returned_first, {"head": K, "draft_hidden": K}, (FORWARD,), tag=TAG))


class Path:
    """One proposal path: present in a release when `marker` is defined or imported at the top
    of the worker module (None: in every release, its hooks required);
    `producer`: how forward_batch_generation's draft_next reads its eager result."""

    def __init__(self, name, marker, producer, hooks, callers=None):
        self.name, self.marker, self.producer, self.hooks = name, marker, producer, hooks
        self.callers = callers or {}  # method hook binding -> the functions allowed to call it


PATHS = (
    Path("plain head", None, "self._greedy_sample_from_vocab_parallel_head",
         (PLAIN,), {PLAIN.binding: (FORWARD,)}),
    Path("selector lattice", "_SelectorDraftSampler", "self._propose_selector_block", SELECTOR,
         {SELECTOR[1].binding: (FORWARD, "DFlashWorkerV2._warm_eager_selector")}),
    Path("Domino rollout", "_DominoDraftSampler", "domino_greedy_rollout", DOMINO),
    Path("LiLiCorr", "propose_lilicorr_block", "propose_lilicorr_block", LILI),
)
CAPTURED_READ = "self._draft_sampler.out"  # a captured sampler's block, read after the replay
SAMPLER_BUILDERS = {"_DflashDraftSampler", "_SelectorDraftSampler", "_DominoDraftSampler",
                    "build_lilicorr_draft_sampler", "_eager"}


def _tree(text: str) -> ast.Module:
    """A source text parsed once per process (syntax.parse: every decision reads the same
    files; the trees are only read)."""
    return syntax.parse(textwrap.dedent(text))


def _defined(contract: Contract, name: str) -> bool:
    tree = _tree(contract.source())
    return any(isinstance(n, (ast.FunctionDef, ast.ClassDef)) and n.name == name for n in tree.body) or any(
        isinstance(n, ast.ImportFrom) and any(a.name == name for a in n.names) for n in tree.body)


def _parsed(contract: Contract, dotted: str) -> ast.Module:
    return _tree(contract.function_source(dotted))


def _producer(value: ast.AST) -> str:
    """What a draft_next assignment reads: `X(...).view(...)` or `X[...]...` -> X."""
    node = value
    while True:
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "view":
            node = node.func.value
        elif isinstance(node, ast.Subscript):
            node = node.value
        else:
            break
    return ast.unparse(node.func if isinstance(node, ast.Call) else node)


def _producers(contract: Contract) -> tuple[tuple[int, str], ...]:
    return _producers_in(contract.function_source(FORWARD))


@functools.lru_cache(maxsize=16)
def _producers_in(text: str) -> tuple[tuple[int, str], ...]:
    function = _tree(text)
    found = []
    for node in ast.walk(function):
        if isinstance(node, ast.Assign):
            names = [n.id for t in node.targets for n in ast.walk(t) if isinstance(n, ast.Name)]
            if "draft_next" in names:
                found.append((node.lineno, _producer(node.value)))
    return tuple(found)


def _check_proposals(contract: Contract, paths) -> None:
    """Every block forward_batch_generation proposes comes from a path this site judged,
    and every captured sampler is one of the judged classes."""
    allowed = {p.producer for p in paths} | {CAPTURED_READ}
    producers = _producers(contract)
    if not producers:
        raise contract.refuse(FORWARD, "no longer assigns draft_next: the proposal moved")
    for line, producer in producers:
        if producer not in allowed:
            raise contract.refuse(FORWARD, f"draft_next comes from {producer} (line {line} of the function), a "
                                           "proposal path this site has not judged")
    built = _parsed(contract, "DFlashWorkerV2._maybe_build_draft_sampler")
    for node in ast.walk(built):
        if isinstance(node, ast.Return) and node.value is not None and not (
                isinstance(node.value, ast.Constant) and node.value.value is None):
            made = ast.unparse(node.value.func) if isinstance(node.value, ast.Call) else ast.unparse(node.value)
            if made not in SAMPLER_BUILDERS:
                raise contract.refuse("DFlashWorkerV2._maybe_build_draft_sampler",
                                      f"builds a draft sampler with {made}, which this site has not judged")


def _check_gathered(contract: Contract) -> None:
    """The paths judged TP-safe still select from an all-gathered table."""
    sampler = contract.function_source("_DflashDraftSampler.__call__")
    if "all_gather_into_tensor(" not in sampler:
        raise contract.refuse("_DflashDraftSampler.__call__", "no longer all-gathers the per-shard maxima: its "
                                                               "proposal is not shown to agree across ranks")
    head = contract.function_source(PLAIN.binding)
    if 'if not hasattr(lm_head, "shard_indices"):' not in head or "all_gather_into_tensor(" not in head:
        raise contract.refuse(PLAIN.binding, "no longer branches on shard_indices and all-gathers the per-shard "
                                             "maxima: which of its proposals are rank-local is not shown")


def _check_samplers(contract: Contract, hook: Hook) -> None:
    """A captured sampler's block is self.out[:bs * (block_size - 1)]: it writes self.out."""
    text = contract.function_source(hook.binding)
    if "self.out[" not in text or "self.block_size" not in text:
        raise contract.refuse(hook.binding, "no longer writes its block to self.out[:bs * (block_size - 1)]")


def _returned(func: ast.FunctionDef, hook: Hook) -> list:
    """The values of the hook's block that leave `func`: what each return hands back (its
    first element for a tuple the block leads), where the pack's wrapper would broadcast."""
    scope = func
    if hook.wrapper is _plain_head:  # the rank-local branch only, as the wrapper's own test
        scope = next((n for n in ast.walk(func) if isinstance(n, ast.If)
                      and ast.unparse(n.test) == "not hasattr(lm_head, 'shard_indices')"), None)
        if scope is None:
            return [None]
    values = []
    for node in ast.walk(scope):
        if isinstance(node, ast.Return) and node.value is not None:
            value = node.value
            if hook.wrapper is _returned_first and isinstance(value, ast.Tuple) and value.elts:
                value = value.elts[0]
            values.append(value)
    return values


def engine_broadcast(contract: Contract, hook: Hook, on: dict) -> Optional[str]:
    """The engine site (of `on`: name -> label, the sites the engine's switch keeps on) at
    which the hooked function broadcasts the block itself through the worker's SpecTpSync,
    read from its source; None where it is not shown (the pack then broadcasts it)."""
    func = _parsed(contract, hook.binding).body[0]
    synced = {}
    for node in ast.walk(func):
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "sync"
                and "tp_sync" in ast.unparse(node.func.value) and len(node.args) == 2
                and isinstance(node.args[0], ast.Attribute) and node.args[0].attr in on):
            synced[ast.unparse(node.args[1])] = node.args[0].attr
    if hook.wrapper is _captured_block:
        found = [site for value, site in synced.items() if value.startswith("self.out")]
        return on[found[0]] if found else None
    values = _returned(func, hook)
    sites = {synced.get(ast.unparse(v)) if v is not None else None for v in values}
    if not values or None in sites or len(sites) != 1:
        return None
    return on[sites.pop()]


def plan(engine, modules: dict, recorded: bool, engine_sync: bool, on: Optional[dict] = None) -> Plan:
    """The site's patches on this release (`modules`: rank0_broadcast's target modules;
    `recorded`: another plan already records the DFlash group in DFlashWorkerV2.__init__;
    `engine_sync`: the release has SpecTpSync, shown to be built over the batch group; `on`:
    the engine's sites its switch keeps on, name -> label). A path whose every hooked
    function the engine shows to broadcast its block itself at one of those sites is the
    engine's (sgl-project/sglang#40246, recognised by what its code does); the rest are the pack's."""
    worker = Contract(NAME, modules[WORKER])
    paths = [p for p in PATHS if p.marker is None or _defined(worker, p.marker)]
    _check_proposals(worker, paths)
    _check_gathered(worker)
    patches: list[Patch] = []
    engines, ours = [], []
    for path in paths:
        checked = []
        for hook in path.hooks:
            module = modules.get(hook.module) or target_modules(NAME, engine, ((hook.module, True),))[hook.module]
            contract = worker if hook.module == WORKER else Contract(NAME, module)
            checked.append(check_hook(contract, hook))
            if hook.wrapper is _captured_block:
                _check_samplers(contract, hook)
            if hook.binding in path.callers:
                contract.only_used_in(hook.binding.rpartition(".")[2], path.callers[hook.binding], attribute=True)
            checked[-1] = (checked[-1], engine_broadcast(contract, hook, on or {}))
        sites = {site for _, site in checked}
        if None not in sites:
            engines.append(f"{path.name} ({', '.join(sorted(sites))})")
        else:
            ours.append(path)
            patches += [patch for patch, _ in checked]
    engine_part = f"; the engine broadcasts these paths itself: {', '.join(engines)}" if engines else ""
    if not ours:
        return Plan("superseded", f"{SITE.label} (the pack's own site): every DFlash greedy draft path of this release "
                                  f"is broadcast by the engine itself, shown from its source{engine_part}",
                    short_reason=f"{SITE.label}: the engine is shown to broadcast every DFlash greedy draft path itself")
    if not recorded:
        patches.insert(0, check_hook(worker, ENGINE_GROUP if engine_sync else RECORDER))
    judged = ", ".join(p.name for p in ours)
    # the group _record_group resolves, where this plan records it
    groups = "" if recorded or engine_sync else f"; the groups: {parallel_groups.check(NAME, engine)}"
    return Plan("applied", f"{SITE.label} (the pack's own site) at {', '.join(p.where for p in patches)}: "
                           f"DFlash greedy draft paths {judged} (the captured plain head all-gathers: TP-safe)"
                           f"{engine_part}{groups}", patches,
                short_reason=f"the pack broadcasts {SITE.label} ({judged})")
