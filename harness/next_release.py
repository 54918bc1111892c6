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

A tree is the installed release's files hard-linked (a changed file is written anew, so
the installed release is never touched), importable with the tree first on the path.
"""

from __future__ import annotations

import importlib.util
import os
import pathlib
import shutil

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


FIXES = {"39954-pr": fix_39954_pr, "39954-refactor": fix_39954_refactor, "40246-pr": site_40246_pr,
         "40246-refactor": site_40246_refactor, "31195": sync_cpu_31195}


def tree(into, fixes, version: str = "0.5.24") -> pathlib.Path:
    """A copy of the installed engine under `into` (which then holds sglang/), with `fixes`
    (names of FIXES) applied and labelled `version`, as a preview build is: its generated
    sglang/_version.py says so and no dist-info sits beside it."""
    into = pathlib.Path(into)
    shutil.copytree(SITE_PACKAGES / "sglang", into / "sglang", copy_function=os.link,
                    ignore=shutil.ignore_patterns("__pycache__"))
    version_file = into / "sglang" / "_version.py"
    version_file.unlink(missing_ok=True)
    version_file.write_text(f"__version__ = version = {version!r}\n"
                            f"__version_tuple__ = version_tuple = {tuple(version.split('.'))!r}\n"
                            "__commit_id__ = commit_id = None\n")
    for name in fixes:
        FIXES[name](into)
    return into
