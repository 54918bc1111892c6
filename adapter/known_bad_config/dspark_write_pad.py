"""The hazard: DSpark's verify window beyond what the DeepSeek-V4 compress write plan keeps.

A DeepSeek-V4 verify step plans which tokens' raw KV it persists into the compress-state
ring from the optimistic `prefix_len + num_draft_tokens`, then rolls back to the accepted
length; every committed token must stay resident for a later compression window to read.
Up to sglang 0.5.17 the plan kernel (`c_plan.cuh`) caps that write pad at a constant:
`mtp_pad = min(ring_size - compress_ratio, kMaxMTPDraftTokens)` with kMaxMTPDraftTokens = 4,
so a verify window (`speculative_num_draft_tokens`, DSpark's block size + 1) above 4
under-writes the ring and later compressions read stale KV: no error, wrong tokens
(sgl-project/sglang#34959 on 4 x H200, TP 4: block size 3, window 4: 0 typos in 7,499
identifiers; block size 4: 0.118 %; block size 6: 0.511 %; the mechanism:
sgl-project/sglang#33872). The fix, sgl-project/sglang#34189, derives the pad from the ring
(`ring_size - window_size + 2`: 10 for the c4 ring of 16, 130 for the c128 ring of 256),
mirrors it in Python (`get_compress_state_write_pad` in the DeepSeek-V4 memory pool) and
has the pool configurator refuse a window beyond it: the engine then guards itself.

What this tree carries is read from its code and judged by running it, never by its label
or the names it uses:
- the Python mirror: the function the pool configurator bounds the draft count with, found
  from that call (through imports and aliases, wherever it lives, whatever its name) and run:
  derived where it grows with the ring, else capped at its value;
- the kernel's own write plan, where the tree ships its source (an installed engine does, and
  so do the trees the compatibility matrix unpacks): every `mtp_pad` declaration in
  `c_plan.cuh`, derived from ring and window, or capped by a constant whose value is then
  the bound.
Mirror and kernel derive the pad: superseded. The mirror derives it but the tree ships no
kernel source: never superseded from the mirror alone; a verify window within upstream's old
cap of 4 is allowed (no release's plan kept fewer), a wider one is decided at launch (a rank
reads its engine's, and refuses where it cannot). Otherwise the bound is the smaller cap
(upstream's 4 where the kernel's source is not in the tree), and the deployment's verify
window is judged against it.
"""

from __future__ import annotations

import ast
import pathlib
import re
from typing import NamedTuple, Optional

from ..engine import syntax
from ..engine.contract import Contract, Undecided, source_proof, target_modules
from ..engine.installed import from_source
from ..engine.source_engine import small_text
from ..framework.plan import Plan

POOL = "sglang.srt.mem_cache.deepseek_v4_memory_pool"
CONFIGURATOR = "sglang.srt.model_executor.pool_configurator"
PAD = "get_compress_state_write_pad"
KERNEL = "csrc/deepseek_v4/c_plan.cuh"  # under sglang/jit_kernel (0.5.16) or sglang/kernels/jit (0.5.17+)
UPSTREAM_CAP = 4  # kMaxMTPDraftTokens in c_plan.cuh before sgl-project/sglang#34189
DSPARK = "DSPARK"
SERVER_ARGS = ("speculative_algorithm", "speculative_num_draft_tokens", "speculative_dspark_block_size")

THREADS = "sgl-project/sglang#34959; the mechanism: sgl-project/sglang#33872; the fix: sgl-project/sglang#34189"
SAFE = (f"--speculative-dspark-block-size {UPSTREAM_CAP - 1} (verify window {UPSTREAM_CAP}) or lower, or an engine "
        "that derives the write pad (sgl-project/sglang#34189)")

_DECLARED = re.compile(r"\b(?:auto|int|int32_t)\s+mtp_pad\s*=\s*([^;]+);")
_CONSTANT = re.compile(r"\bconstexpr\s+\w+\s+(k\w+)\s*=\s*(\d+)\s*;")


class Kernel(NamedTuple):
    """The plan kernel's write pad: `cap` None where it is derived from ring and window."""

    path: str
    cap: Optional[int]
    expression: str

    def describe(self) -> str:
        how = "derived from the ring" if self.cap is None else f"capped at {self.cap}"
        return f"{self.path}: mtp_pad = {self.expression} ({how})"


def kernel(contract: Contract) -> Optional[Kernel]:
    """The write pad of the plan kernel beside the memory pool's module, None where the tree
    does not ship the kernel's source. Refused where the pad is in no shape the pack knows."""
    package = pathlib.Path(contract.module.__file__).parents[2]  # sglang/srt/mem_cache/<pool>.py
    found = sorted(package.glob(f"*/{KERNEL}")) + sorted(package.glob(f"*/*/{KERNEL}"))
    text = small_text(found[0]) if found else None
    if text is None:
        return None
    where, constants, shapes = str(found[0].relative_to(package.parent)), dict(_CONSTANT.findall(text)), set()
    for expression in {" ".join(e.split()) for e in _DECLARED.findall(text)}:
        capped = [int(constants[name]) for name in re.findall(r"\bk\w+", expression) if name in constants]
        if capped and "std::min" in expression:
            shapes.add(Kernel(where, min(capped), expression))
        elif not capped and {"ring_size", "window_size"} <= set(re.findall(r"\w+", expression)):
            shapes.add(Kernel(where, None, expression))
        else:
            shapes.add(None)
    if len(shapes) != 1 or None in shapes:
        raise contract.refuse(f"{where}:mtp_pad", f"the compress write plan's pad is declared {len(shapes)} ways, "
                                                  "or in a shape the pack does not know")
    return shapes.pop()


class Mirror(NamedTuple):
    """The pad the pool configurator bounds the draft count with, run: `cap` None where it is
    derived from the ring (it grows with ring_size), else its constant value."""

    where: str
    line: int
    cap: Optional[int]

    def describe(self) -> str:
        how = ("derives the pad from the ring" if self.cap is None else f"caps the pad at {self.cap}")
        return f"{self.where}(compress_ratio, ring_size) {how} ({CONFIGURATOR} bounds the draft count with it, line {self.line})"


@source_proof("write-pad-bound")
def _bound_call(configurator: Contract) -> Optional[tuple[str, int]]:
    """(the callee, its line) of the configurator's `bound = f(x, y)` whose value a draft
    count is compared with; None where no draft count is bounded so. Read from its source
    alone, and kept under it: every decision asks it."""
    for func in ast.walk(syntax.parse(configurator.source())):
        if not isinstance(func, ast.FunctionDef):
            continue
        bounds = {t.id: node for node in ast.walk(func) if isinstance(node, ast.Assign) and isinstance(node.value, ast.Call)
                  and len(node.value.args) == 2 for t in node.targets if isinstance(t, ast.Name)}
        for compare in (n for n in ast.walk(func) if isinstance(n, ast.Compare)):
            names = {n.id for n in ast.walk(compare) if isinstance(n, ast.Name)}
            if any("draft" in name for name in names) and names & set(bounds):
                node = bounds[sorted(names & set(bounds))[0]]
                return ast.unparse(node.value.func), node.lineno
    return None


def _run_pad(engine, home: Contract, name: str):
    """The pad function itself, to be called: the installed one, or, read from source, its
    definition alone compiled (it is a small pure function: anything it needs beyond its
    arguments and the builtins makes it unrunnable here)."""
    if not from_source(home.module):
        return getattr(home.module, name)
    (node,) = [n for n in syntax.parse(home.source()).body if isinstance(n, ast.FunctionDef) and n.name == name]
    node = ast.FunctionDef(**{**node.__dict__, "decorator_list": [], "returns": None,
                              "args": ast.arguments(**{**node.args.__dict__, "args": [ast.arg(a.arg) for a in node.args.args]})})
    namespace: dict = {}
    exec(compile(ast.fix_missing_locations(ast.Module([node], [])), home.module.__file__, "exec"), namespace)
    return namespace[name]


def python_mirror(engine, pool: Contract, configurator: Contract) -> Optional[Mirror]:
    """The pad the configurator bounds the draft count with, wherever it lives and whatever its
    name (followed from the call, through imports and aliases), judged by running it: derived
    where it grows with the ring, else capped at its value. None where no draft count is
    bounded (a tree before sgl-project/sglang#34189); Undecided where it cannot run here."""
    found = _bound_call(configurator)
    if found is None:
        return None
    callee, line = found
    built = built_class.follow(configurator, engine, callee, function=True)
    home = Contract(NAME, engine.module(built.module))
    where = f"{built.module}.{built.name}"
    try:
        pad = _run_pad(engine, home, built.name)
        small, large = pad(4, 16), pad(4, 64)  # the c4 ring and one four times as large
    except Exception as exc:  # noqa: BLE001  (what it needs beyond its arguments is not here)
        raise Undecided(NAME, where, f"the write pad the configurator bounds the draft count with (line {line}) cannot "
                                     f"be run here ({type(exc).__name__}: {exc}); each rank runs its own",
                        engine.version) from None
    if not (isinstance(small, int) and isinstance(large, int)):
        raise pool.refuse(where, f"returns {small!r}, not a token count")
    return Mirror(where, line, None if large > small else large)


def verify_window(args) -> tuple[Optional[int], str]:
    """The deployment's verify window (tokens one verify step writes per request) and where
    it comes from; None where the engine resolves it at launch (from the draft checkpoint)."""
    tokens, block = args["speculative_num_draft_tokens"], args["speculative_dspark_block_size"]
    if tokens is not None:
        return int(tokens), f"speculative_num_draft_tokens {int(tokens)}"
    if block is not None:
        return int(block) + 1, f"--speculative-dspark-block-size {int(block)} + 1"
    return None, ""


def plan(engine, context) -> Plan:
    """Superseded where the tree's write plan and the configurator both derive the write pad;
    decided at launch where the tree ships no kernel source to show the plan's; else the
    deployment's DSpark verify window against the smaller of the bounds: allowed (applied,
    nothing patched), refused, or decided at launch where the window is not known here."""
    modules = target_modules(NAME, engine, ((POOL, True), (CONFIGURATOR, True)))
    pool, configurator = Contract(NAME, modules[POOL]), Contract(NAME, modules[CONFIGURATOR])
    mirror, pad = python_mirror(engine, pool, configurator), kernel(pool)
    said = pad.describe() if pad is not None else "the kernel's source is not in this tree"
    mirrored = mirror.describe() if mirror is not None else f"{CONFIGURATOR} bounds no draft count with a write pad"
    if mirror is not None and mirror.cap is None:
        if pad is None:  # a window within upstream's old cap is safe whatever the kernel; beyond it, unshown
            unshown = Undecided(NAME, f"{POOL}:{KERNEL.rpartition('/')[2]} mtp_pad",
                                f"{mirrored}, but {said}: the write plan a verify step runs cannot be shown from "
                                f"here, and a verify window above {UPSTREAM_CAP} (its cap before "
                                "sgl-project/sglang#34189) is safe only where it derives the pad; each rank judges "
                                "its own engine's", engine.version)
            how = f"{mirrored}; {said}, and no release's write plan kept fewer than {UPSTREAM_CAP} draft tokens"
            return _judge(engine, pool, UPSTREAM_CAP, how, context, beyond=unshown)
        if pad.cap is None:
            return Plan("superseded", f"the engine derives the DeepSeek-V4 compress write pad itself: {mirrored}; the "
                                      f"engine refuses a verify window beyond it itself; {said}",
                        short_reason="the engine derives the compress write pad from its ring and bounds the window")
    caps = [c for c in (mirror.cap if mirror is not None else None, pad.cap if pad is not None else UPSTREAM_CAP)
            if c is not None]
    bound = min(caps)
    how = (f"this tree's compress write plan keeps at most {bound} draft tokens resident ({mirrored}; "
           + (said if pad is not None else f"{said}: its cap before sgl-project/sglang#34189, kMaxMTPDraftTokens = "
                                           f"{UPSTREAM_CAP}") + ")")
    return _judge(engine, pool, bound, how, context)


def _judge(engine, pool: Contract, bound: int, how: str, context, beyond: Optional[Undecided] = None) -> Plan:
    """The deployment's window against `bound`; beyond it, refused, or `beyond` raised where
    the bound is only the smallest the tree could have."""
    args = context.topology.server_args if context.topology is not None else None
    if args is None:
        raise Undecided(NAME, "speculative_num_draft_tokens",
                        f"the deployment's server arguments are not known here; {how}: each rank judges the DSpark "
                        f"verify window its engine resolves and refuses one above {bound}", engine.version)
    algorithm = str(args["speculative_algorithm"] or "").upper()
    if algorithm != DSPARK:
        return Plan("applied", f"nothing to refuse: the deployment runs no DSpark (speculative algorithm "
                               f"{algorithm or 'none'}); {how}", short_reason="no DSpark in this deployment: nothing to refuse")
    window, said = verify_window(args)
    if window is None:
        raise Undecided(NAME, "--speculative-dspark-block-size",
                        f"not on the command line: the engine reads the block size from the draft checkpoint "
                        f"(dspark_block_size); {how}: each rank judges the verify window it resolves and refuses "
                        f"one above {bound}", engine.version)
    if window <= bound:
        return Plan("applied", f"DSpark verify window {window} ({said}) is within the bound: {how}; nothing patched",
                    short_reason=f"DSpark verify window {window} is within the {bound} draft tokens the write plan keeps")
    if beyond is not None:
        raise beyond
    raise pool.refuse(PAD, f"DSpark verify window {window} exceeds {bound} ({said}): {how}, so a DeepSeek-V4 verify "
                           f"step under-writes the compress-state ring and later compressions read stale KV, corrupting "
                           f"output without an error ({THREADS}); safe: {SAFE}; a target without DeepSeek-V4 "
                           f"compressed attention is not affected: switch {FLAG} off there")


from ..spectpsync import built_class  # noqa: E402  (follows a name through imports and aliases)
from . import FLAG, NAME  # noqa: E402  (the package defines them before it imports this file)
