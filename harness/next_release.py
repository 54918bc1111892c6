"""Next-release engine trees: copies of the installed sglang 0.5.23 with upstream's open fixes
applied as their pull requests describe them, labelled as a preview image (0.0.0.dev0) or
the next release (0.5.24) would be. Each fix comes in two shapes: the pull request's own
and a refactor of it that does the same thing in other words, so that a fix is recognised
by what it does, never by one spelling.

- sgl-project/sglang#39954: SpecTpSync keeps the configured sites apart from its group, and
  available_memory_gb reduces over the caller's group whenever the site is configured.
- sgl-project/sglang#40246: a new SpecTpSyncSite member for DFlash's greedy draft proposal,
  broadcast by the engine on the selector lattice and the eager plain head (the PR's paths
  that live in the worker); the pack has never seen the site.
- sgl-project/sglang#31195: SpecTpSync.sync_cpu and the planner's verify-budget sync.

Beside the fixes, ordinary refactors of the same release (REFACTORS): SpecTpSync renamed
with an alias, moved and re-exported, subclassed, its probe decorated or delegated, a site
of the engine's own given a number the pack uses. None of them changes what runs but the
one that is there to be refused (`subclass-drops-broadcast`).

A tree is the installed release's files hard-linked (a changed file is written anew, so
the installed release is never touched), importable with the tree first on the path. Its
bytecode cache comes along: Python checks each cached file against its source's time and
size, so a file written anew is compiled again (and its cache written as a file of its own,
Python replaces it), and the rest import as the installed release does, about 4 s less for
a tree's first interpreter.
"""

from __future__ import annotations

import importlib.util
import pathlib

from .engines import linked_copy

SITE_PACKAGES = pathlib.Path(importlib.util.find_spec("sglang").origin).parent.parent
SYNC = "srt/speculative/spec_tp_sync.py"
WORKER = "srt/speculative/dflash_worker_v2.py"
PLANNER = "srt/speculative/dspark_components/dspark_planner.py"
KEPT = "        self._sites = sites if tp_group.world_size > 1 else frozenset()\n"
PROBE = "        distributed = self.enabled(site) and group.world_size > 1\n"
BROADCAST = "        if site in self._sites:\n            self._tp_group.broadcast(values, src=0)\n        return values\n"


def edit(root: pathlib.Path, relative: str, *replacements: tuple[str, str]) -> None:
    """Replace each `old` (present exactly once) in root/sglang/relative, as a new file."""
    path = root / "sglang" / relative
    text = path.read_text(encoding="utf-8")
    for old, new in replacements:
        assert text.count(old) == 1, f"{relative}: {old!r} is not there exactly once"
        text = text.replace(old, new)
    path.unlink()  # a hard link to the installed file: write a file of its own
    path.write_text(text, encoding="utf-8")


# ---------------------------------------------------------------- sgl-project/sglang#39954

def fix_39954_pr(root):
    edit(root, SYNC, (KEPT, "        # Runtime broadcasts follow the constructor group; the memory probe can be asked\n"
                            "        # to reduce over a larger group, so the configured sites are kept apart.\n"
                            "        self._configured_sites = sites\n" + KEPT),
         (PROBE, "        distributed = site in self._configured_sites and group.world_size > 1\n"))


def fix_39954_refactor(root):
    """The same behaviour in other words: the selection held by a small record, the
    broadcast and the reduction in helper methods (sync no longer calls broadcast itself)."""
    edit(root, SYNC,
         ("class SpecTpSync:\n",
          "class _Selection:\n    def __init__(self, configured, active):\n"
          "        self.configured, self.active = configured, active\n\n\nclass SpecTpSync:\n"),
         (KEPT, "        self._sites = sites if tp_group.world_size > 1 else frozenset()\n"
                "        self._selection = _Selection(sites, self._sites)\n"),
         ("        return site in self._sites\n", "        return site in self._selection.active\n"),
         (BROADCAST, "        if self.enabled(site):\n            self._send_from_rank0(values)\n        return values\n\n"
                     "    def _send_from_rank0(self, values):\n        self._tp_group.broadcast(values, src=0)\n"),
         (PROBE, "        distributed = self._reduces(site, group)\n"),
         ("    def available_memory_gb(", "    def _reduces(self, site, group) -> bool:\n"
                                        "        return group.world_size > 1 and site in self._selection.configured\n\n"
                                        "    def available_memory_gb("))


# ---------------------------------------------------------------- sgl-project/sglang#40246

SITE_40246 = ("    DFLASH_TARGET = 16\n", "    DFLASH_TARGET = 16\n"
              "    DFLASH_DRAFT_GREEDY = 18  # greedy draft proposal: rank-local argmax over vocab-parallel logits\n")


def _sync_draft_paths(root, site: str):
    """The engine broadcasts the eager selector block and the plain head's per-rank argmax
    at `site` (the worker's own SpecTpSync)."""
    edit(root, WORKER,
         ("        return tokens.view(bs, num_pred)\n",
          f"        block = tokens.view(bs, num_pred)\n        self._tp_sync.sync(SpecTpSyncSite.{site}, block)\n"
          "        return block\n"),
         ("                out_tokens[start:end] = torch.argmax(logits, dim=-1).to(torch.long)\n            return out_tokens\n",
          "                out_tokens[start:end] = torch.argmax(logits, dim=-1).to(torch.long)\n"
          f"            self._tp_sync.sync(SpecTpSyncSite.{site}, out_tokens)\n            return out_tokens\n"))


def site_40246_pr(root):
    edit(root, SYNC, SITE_40246)
    _sync_draft_paths(root, "DFLASH_DRAFT_GREEDY")


def site_40246_refactor(root):
    """Another name and number, declared first and documented above its line."""
    edit(root, SYNC, ("    # -- DFlash --\n", "    # -- DFlash --\n    # DFlash's greedy draft proposal, made per rank\n"
                                             "    DFLASH_PROPOSAL = 21\n"))
    _sync_draft_paths(root, "DFLASH_PROPOSAL")


# ---------------------------------------------------------------- sgl-project/sglang#31195

def sync_cpu_31195(root):
    edit(root, SYNC, ("    def available_memory_gb(",
                      "    def sync_cpu(self, site: SpecTpSyncSite, value):\n"
                      "        \"\"\"Broadcast a host integer from rank 0 over the CPU group (-1 for None).\"\"\"\n"
                      "        if site not in self._sites:\n            return value\n"
                      "        wire = torch.tensor([-1 if value is None else int(value)], dtype=torch.int64)\n"
                      "        torch.distributed.broadcast(wire, src=self._tp_group.ranks[0], "
                      "group=self._tp_group.cpu_group)\n"
                      "        return None if int(wire.item()) == -1 else int(wire.item())\n\n"
                      "    def available_memory_gb("))


# ---------------------------------------------------------------- ordinary refactors

WORKER_FILES = (WORKER, "srt/speculative/dspark_components/dspark_worker_v2.py")
IMPORT = "from sglang.srt.speculative.spec_tp_sync import SpecTpSync, SpecTpSyncSite\n"
BUILT = "        self._tp_sync = SpecTpSync(get_dp_tp_group())\n"
RENAMED = ("class SpecTpSync:\n", "class SpecTpBroadcaster:\n")
ALIAS = "\n\n# The old name, kept for callers that still use it.\nSpecTpSync = SpecTpBroadcaster\n"


def _append(root, relative: str, text: str) -> None:
    path = root / "sglang" / relative
    content = path.read_text(encoding="utf-8") + text
    path.unlink()
    path.write_text(content, encoding="utf-8")


def _workers(root, imported: str, built: str) -> None:
    """Both workers import `imported` (a line) beside the old import and build with `built`."""
    for relative in WORKER_FILES:
        edit(root, relative, (IMPORT, IMPORT + imported), (BUILT, built))


def rename_alias(root):
    """SpecTpSync renamed SpecTpBroadcaster, the old name an alias at the module's end; the
    workers build it by the new name."""
    edit(root, SYNC, RENAMED)
    _append(root, SYNC, ALIAS)
    _workers(root, "from sglang.srt.speculative.spec_tp_sync import SpecTpBroadcaster\n",
             "        self._tp_sync = SpecTpBroadcaster(get_dp_tp_group())\n")


def rename_import_as(root):
    """Renamed as above; the workers import it under a name of their own."""
    edit(root, SYNC, RENAMED)
    _append(root, SYNC, ALIAS)
    _workers(root, "from sglang.srt.speculative.spec_tp_sync import SpecTpBroadcaster as TpBroadcast\n",
             "        self._tp_sync = TpBroadcast(get_dp_tp_group())\n")


def rename_factory(root):
    """Renamed as above; the workers build it through a factory function."""
    edit(root, SYNC, RENAMED)
    _append(root, SYNC, ALIAS + "\n\ndef make_tp_sync(tp_group):\n    return SpecTpBroadcaster(tp_group)\n")
    _workers(root, "from sglang.srt.speculative.spec_tp_sync import make_tp_sync\n",
             "        self._tp_sync = make_tp_sync(get_dp_tp_group())\n")


HOME = "srt/speculative/spec_tp_broadcast.py"


def moved_reexport(root):
    """The module moved whole to spec_tp_broadcast.py, spec_tp_sync.py re-exporting it; the
    workers import from the new home under a name of their own."""
    old = root / "sglang" / SYNC
    (root / "sglang" / HOME).write_text(old.read_text(encoding="utf-8"), encoding="utf-8")
    old.unlink()
    old.write_text('"""Moved to spec_tp_broadcast; kept for its importers."""\n\n'
                   "from sglang.srt.speculative.spec_tp_broadcast import (  # noqa: F401\n"
                   "    _ALL, SpecTpSync, SpecTpSyncSite, parse_spec_tp_sync,\n)\n", encoding="utf-8")
    _workers(root, "from sglang.srt.speculative.spec_tp_broadcast import SpecTpSync as MovedSync\n",
             "        self._tp_sync = MovedSync(get_dp_tp_group())\n")


def _subclass(root, body: str):
    (root / "sglang" / HOME).write_text(
        "from sglang.srt.speculative.spec_tp_sync import SpecTpSync\n\n\n"
        "class SpecTpBroadcaster(SpecTpSync):\n    \"\"\"The rank-0 broadcast, with a place for tracing.\"\"\"\n\n" + body,
        encoding="utf-8")
    _workers(root, "from sglang.srt.speculative.spec_tp_broadcast import SpecTpBroadcaster\n",
             "        self._tp_sync = SpecTpBroadcaster(get_dp_tp_group())\n")


def subclass_reexport(root):
    """A subclass in another module, the workers building it; its sync defers to the base."""
    _subclass(root, "    def sync(self, site, values):\n        return super().sync(site, values)\n")


def subclass_drops_broadcast(root):
    """As above, but its sync returns the values without broadcasting: what runs no longer
    does the job (to be refused)."""
    _subclass(root, "    def sync(self, site, values):\n        return values\n")


CONFIGURED = (KEPT, "        self._configured_sites = sites\n" + KEPT)
DECORATOR = '''
def _over_configured(probe):
    """A configured site reduces over the caller's group (#39954 as a decorator)."""
    {wraps}def reduced(self, site, device, gpu_id, *, group):
        if site in self._configured_sites and group.world_size > 1:
            return get_available_gpu_memory(device, gpu_id, distributed=True, cpu_group=group.cpu_group)
        return probe(self, site, device, gpu_id, group=group)
    return reduced


class SpecTpSync:
'''


def _decorated(root, wraps: str):
    edit(root, SYNC, ("import logging\n", "import functools\nimport logging\n"),
         ("class SpecTpSync:\n", DECORATOR.format(wraps=wraps)), CONFIGURED,
         ("    def available_memory_gb(", "    @_over_configured\n    def available_memory_gb("))


def decorator_wraps(root):
    """sgl-project/sglang#39954 written as a decorator on available_memory_gb (functools.wraps)."""
    _decorated(root, "@functools.wraps(probe)\n    ")


def decorator_plain(root):
    """The same decorator without functools.wraps."""
    _decorated(root, "")


def probe_staticmethod(root):
    """sgl-project/sglang#39954 with the probe delegated to a staticmethod that calls a module
    function."""
    edit(root, SYNC, CONFIGURED,
         ("class SpecTpSync:\n",
          "def _free_memory(on, device, gpu_id, group):\n"
          "    distributed = on and group.world_size > 1\n"
          "    return get_available_gpu_memory(\n        device, gpu_id, distributed=distributed,\n"
          "        cpu_group=group.cpu_group if distributed else None,\n    )\n\n\nclass SpecTpSync:\n"),
         ("    def available_memory_gb(self, site: SpecTpSyncSite, device, gpu_id, *, group):\n",
          "    _probe = staticmethod(_free_memory)\n\n"
          "    def available_memory_gb(self, site: SpecTpSyncSite, device, gpu_id, *, group):\n"
          "        return self._probe(site in self._configured_sites, device, gpu_id, group)\n\n"
          "    def _rank_local_probe(self, site, device, gpu_id, *, group):\n"))


def _site(root, number: int):
    edit(root, SYNC, ("    DFLASH_TARGET = 16\n",
                      f"    DFLASH_TARGET = 16\n    DFLASH_DRAFT_GREEDY = {number}  # greedy draft proposal\n"))
    _sync_draft_paths(root, "DFLASH_DRAFT_GREEDY")


def site_31(root):
    """The engine's new site at 31, the number of the pack's own DFlash draft site."""
    _site(root, 31)


def site_30(root):
    """The engine's new site at 30, the number of the pack's own report site."""
    _site(root, 30)


REFACTORS = {"rename-alias": rename_alias, "rename-import-as": rename_import_as, "rename-factory": rename_factory,
             "moved-reexport": moved_reexport, "subclass-reexport": subclass_reexport,
             "subclass-drops-broadcast": subclass_drops_broadcast, "decorator-wraps": decorator_wraps,
             "decorator-plain": decorator_plain, "probe-staticmethod": probe_staticmethod,
             "site-31": site_31, "site-30": site_30}


FIXES = {"39954-pr": fix_39954_pr, "39954-refactor": fix_39954_refactor, "40246-pr": site_40246_pr,
         "40246-refactor": site_40246_refactor, "31195": sync_cpu_31195}


def tree(into, fixes, version: str = "0.5.24") -> pathlib.Path:
    """A copy of the installed engine under `into` (which then holds sglang/), with `fixes`
    (names of FIXES) applied and labelled `version`, as a preview build is: its generated
    sglang/_version.py says so and no dist-info sits beside it."""
    into = pathlib.Path(into)
    linked_copy(SITE_PACKAGES / "sglang", into / "sglang")
    version_file = into / "sglang" / "_version.py"
    version_file.unlink(missing_ok=True)
    version_file.write_text(f"__version__ = version = {version!r}\n"
                            f"__version_tuple__ = version_tuple = {tuple(version.split('.'))!r}\n"
                            "__commit_id__ = commit_id = None\n")
    for name in fixes:
        {**FIXES, **REFACTORS}[name](into)
    return into


def proven_here(tree: pathlib.Path, environments=()) -> pathlib.Path:
    """`tree`, with the proof of who reads its logits made in this process first (folded_fence.logits_readers),
    where the sources it shares with the installed release are parsed already: a child that judges
    the tree finds it in the run's proof cache instead of following the engine's code from a cold
    start (about 2 s here against 6 to 8 there). With `environments` (the flags a child will judge
    the tree's sources under), those decisions too: the tree's SpecTpSync runs in this process's warm
    child, and the child finds what it did in the proof cache instead of starting an interpreter
    (about 4 s)."""
    from sglang_dsv41_adapters.engine.source_engine import SourceEngine
    from sglang_dsv41_adapters.folded_fence import logits_readers
    from sglang_dsv41_adapters.framework import runtime

    engine = SourceEngine(tree)
    logits_readers.verdict(engine)
    for environ in environments:
        runtime.decide(environ, engine)
    return tree
