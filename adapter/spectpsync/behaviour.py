"""SpecTpSync as it behaves: the engine's own class run against recording groups.

What the adapters rely on is what the engine's rank-0 broadcast does, not how its source
spells it: a fix upstream lands in its own words (a helper method, a second site set, a
new site), and the next release may number sites the pack has never seen. So the class
is run, for each value of SGLANG_SPEC_TP_SYNC the ranks may read (None: unset):

- built over a group of one rank and of two (this process a rank other than 0), under
  that value presented in os.environ, after "off" and one single site were presented
  first (a class that reads its switch once and keeps it shows there);
- `parse`: what the engine's own parse_spec_tp_sync makes of the value (or its error);
- `selected`: the sites `enabled()` says on, per group size;
- `broadcast`: the sites whose `sync(site, t)` broadcast `t` itself once from rank 0,
  left rank 0's value in it and returned it; anything else is a problem named;
- `reduced`: per (own group size, capture group size), the sites whose
  `available_memory_gb(site, ..., group=capture)` asked the engine helper for the
  minimum over the capture group's cpu_group (the helper is the method's own global,
  replaced in a copy of the class's functions: nothing of the engine is patched).

The installed engine's class runs in this process, the pack's own wrappers looked
through; a release read from its sources runs in a child interpreter with its tree first
on the path, one per tree content (the files that decide it), kept for the life of this process. Where the class cannot run
there the observation says why, and the verdicts that rest on it are decided at launch.

This file imports nothing of the pack: the child runs it by path.
"""

from __future__ import annotations

import atexit
import collections
import contextlib
import hashlib
import json
import logging
import os
import subprocess
import sys
import threading
import types
from typing import Optional

SWITCH = "SGLANG_SPEC_TP_SYNC"
HELPER = "get_available_gpu_memory"
MODULE = "sglang.srt.speculative.spec_tp_sync"
PAIRS = ("1x1", "1x2", "2x1", "2x2")  # own group x capture group, in ranks


class Unobservable(Exception):
    """The class could not be run (the child could not import the tree, or died)."""


class _Group:
    """A group of `world_size` ranks as SpecTpSync sees it, this process a rank other than
    0: `broadcast` records the call and writes rank 0's value in place, as the real one."""

    RANK0 = 7

    def __init__(self, world_size: int):
        self.world_size, self.rank_in_group, self.cpu_group = world_size, 1, object()
        self.ranks, self.local_rank = list(range(world_size)), 1
        self.calls: list = []

    def broadcast(self, tensor, src=0):
        self.calls.append((tensor, src))
        tensor.fill_(self.RANK0)
        return tensor


@contextlib.contextmanager
def _presented(value):
    """os.environ[SWITCH] = value (None: unset) for the duration."""
    before = os.environ.get(SWITCH)
    if value is None:
        os.environ.pop(SWITCH, None)
    else:
        os.environ[SWITCH] = value
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(SWITCH, None)
        else:
            os.environ[SWITCH] = before


@contextlib.contextmanager
def _quiet(name: str):
    logger = logging.getLogger(name)
    before, logger.disabled = logger.disabled, True
    try:
        yield
    finally:
        logger.disabled = before


def _error(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"


class _Rebinder:
    """Copies of functions whose module globals see `helper` as HELPER: the class's own, and
    what they reach (a decorator's wrapped function in its closure, a staticmethod's function,
    a module function called by name), each copied once. Nothing of the engine is changed."""

    def __init__(self, helper):
        self.helper, self.copies, self.spaces = helper, {}, {}

    def space(self, globals_: dict) -> dict:
        """The copy of a module's globals, HELPER replaced and its functions copied on demand."""
        key = id(globals_)
        if key not in self.spaces:
            space = self.spaces[key] = dict(globals_)
            if HELPER in space:
                space[HELPER] = self.helper
            for name, value in globals_.items():
                if isinstance(value, types.FunctionType) and value.__globals__ is globals_ and name != HELPER:
                    space[name] = self.function(value)
        return self.spaces[key]

    def value(self, value):
        if isinstance(value, types.FunctionType):
            return self.function(value)
        if isinstance(value, (staticmethod, classmethod)) and isinstance(value.__func__, types.FunctionType):
            return type(value)(self.function(value.__func__))
        return value

    def function(self, func: types.FunctionType) -> types.FunctionType:
        if id(func) in self.copies:
            return self.copies[id(func)][1]
        self.copies[id(func)] = (func, func)  # under way (a closure that holds itself keeps the original)
        cells = tuple(types.CellType(self.value(c.cell_contents)) if _filled(c) else types.CellType()
                      for c in func.__closure__ or ())
        made = types.FunctionType(func.__code__, self.space(func.__globals__), func.__name__, func.__defaults__,
                                  cells or None)
        made.__kwdefaults__, made.__dict__ = func.__kwdefaults__, dict(func.__dict__)
        if "__wrapped__" in made.__dict__:
            made.__wrapped__ = self.value(made.__wrapped__)
        self.copies[id(func)] = (func, made)
        return made


def _filled(cell) -> bool:
    try:
        cell.cell_contents
    except ValueError:
        return False
    return True


def probe_class(cls, helper_calls: list, originals: dict):
    """A throwaway subclass of `cls` whose functions (its own and its engine bases') are
    copies of the engine's (`originals` where the pack wrapped one) over globals in which the
    helper records its calls, whatever reaches it: a decorator, a staticmethod, a module
    function. `cls` itself is left as it is."""
    def helper(device, gpu_id, distributed=False, empty_cache=True, cpu_group=None):
        helper_calls.append((bool(distributed), cpu_group))
        return 1.0

    rebind, namespace = _Rebinder(helper), {}
    for owner in reversed(cls.__mro__[:-1]):  # the base's first, so that a subclass's own override them
        for name, value in vars(owner).items():
            value = originals.get(name, value) if owner is cls else value
            if isinstance(value, (types.FunctionType, staticmethod, classmethod)):
                namespace[name] = rebind.value(value)
    return type(cls.__name__, (cls,), namespace)


def observe_module(module, values, originals=None, cls=None) -> dict:
    """The observation of `cls` (the class the workers build; default `module.SpecTpSync`)
    with the sites and parser of `module` (a real spec_tp_sync module), for each of `values`."""
    import torch

    cls, sites = cls or module.SpecTpSync, module.SpecTpSyncSite
    parse = getattr(module, "parse_spec_tp_sync", None)
    out = {"sites": {s.name: int(s) for s in sites}, "values": {}}
    helper_calls: list = []
    probe = probe_class(cls, helper_calls, originals or {})

    def build(value, ranks):
        with _presented(value), _quiet(module.__name__):
            group = _Group(ranks)
            return probe(group), group

    def selected(instance):
        return sorted(int(s) for s in sites if instance.enabled(s))

    warmups = _warmups(parse, sites, module.__name__)
    for value in values:
        seen: dict = {"parse": None, "parse_error": None, "built_error": None, "selected": {}, "broadcast": {},
                      "reduced": {}, "problems": [], "sync_problems": [], "probe_problems": []}
        out["values"][json.dumps(value)] = seen
        if value is not None and not callable(parse):
            seen["parse_error"] = "NameError: the module no longer defines parse_spec_tp_sync"
        elif value is not None:
            try:
                with _quiet(module.__name__):
                    seen["parse"] = sorted(int(s) for s in parse(value))
            except Exception as exc:  # the engine's parser refusing the value is an answer, said
                seen["parse_error"] = _error(exc)
        try:
            # First no site and one site, then the value: a switch read once and kept shows here.
            for warmup, want in warmups:
                got = selected(build(warmup, 2)[0])
                if got != want:
                    seen["problems"].append(f"built under {SWITCH}={warmup!r} it selects {got}, not {want}: it does "
                                            "not select by the variable when it is built")
            built = {ranks: build(value, ranks) for ranks in (1, 2)}
        except Exception as exc:
            seen["built_error"] = _error(exc)
            continue
        for ranks, (instance, group) in built.items():
            seen["selected"][str(ranks)] = selected(instance)
            done = []
            for site in sites:
                tensor = torch.zeros(2, dtype=torch.int64)
                try:
                    returned = instance.sync(site, tensor)
                except Exception as exc:
                    seen["sync_problems"].append(f"sync({site.name}) raised {_error(exc)} in a group of {ranks}")
                    continue
                calls, group.calls = group.calls, []
                if returned is not tensor:
                    seen["sync_problems"].append(f"sync({site.name}) returned another tensor than the one it was given")
                elif calls and (len(calls) != 1 or calls[0][0] is not tensor or calls[0][1] != 0
                                or not bool((tensor == _Group.RANK0).all())):
                    seen["sync_problems"].append(f"sync({site.name}) did not broadcast the tensor it was given once from "
                                            f"rank 0 in a group of {ranks}: {len(calls)} call(s)")
                elif calls:
                    done.append(int(site))
            seen["broadcast"][str(ranks)] = sorted(done)
        for pair in PAIRS:
            own, capture = (int(n) for n in pair.split("x"))
            instance, _ = built[own]
            group, reduced = _Group(capture), []
            for site in sites:
                del helper_calls[:]
                try:
                    instance.available_memory_gb(site, "cpu", 0, group=group)
                except Exception as exc:
                    seen["probe_problems"].append(f"available_memory_gb({site.name}) raised {_error(exc)}")
                    continue
                if helper_calls == [(True, group.cpu_group)]:
                    reduced.append(int(site))
                elif len(helper_calls) != 1 or helper_calls[0][0]:  # once, per rank: fine; else not what was asked
                    seen["probe_problems"].append(f"available_memory_gb({site.name}) called the helper {len(helper_calls)} "
                                            f"time(s) ({helper_calls}), not once over the group it was given")
            seen["reduced"][pair] = sorted(reduced)
    return out


def _warmups(parse, sites, name: str) -> list:
    """(value, the sites it selects) for no site and for one site, each in a spelling the
    engine's own parser takes (numbers, slugs and presets are its to change)."""
    first = min(sites, key=int)
    found = []
    for want, spellings in (([], ("off", "none")),
                            ([int(first)], (str(int(first)), getattr(first, "slug", None),
                                            first.name.lower().replace("_", "-")))):
        for spelling in filter(None, spellings):
            try:
                with _quiet(name):
                    if callable(parse) and sorted(int(s) for s in parse(spelling)) == want:
                        found.append((spelling, want))
                        break
            except Exception:  # noqa: BLE001  (a spelling this release does not take)
                continue
    return found


# ---------------------------------------------------------------- a tree, in a child interpreter


# How the child interpreter starts; the test suite starts it from a parent that has imported torch.
popen = subprocess.Popen


class _Child:
    """One interpreter with a source tree first on its path, answering observations."""

    def __init__(self, tree: str):
        env = {k: v for k, v in os.environ.items() if k not in (SWITCH, "PYTHONPATH")}
        env["PYTHONPATH"] = tree
        code = (f"import runpy, sys; sys.argv = ['behaviour', {tree!r}]; sys.path.insert(0, {tree!r}); "
                f"runpy.run_path({os.path.abspath(__file__)!r}, run_name='__child__')")
        self.process = popen([sys.executable, "-c", code], cwd=tree, env=env, stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        self.lock = threading.Lock()

    def ask(self, values) -> dict:
        with self.lock:
            try:
                self.process.stdin.write(json.dumps(values) + "\n")
                self.process.stdin.flush()
                line = self.process.stdout.readline()
            except (BrokenPipeError, OSError):
                line = ""
            if not line:
                self.process.kill()
                tail = self.process.stderr.read()[-600:].strip().replace("\n", " | ")
                raise Unobservable(f"the child interpreter died ({tail or 'no output'})")
        answer = json.loads(line)
        if "error" in answer:
            raise Unobservable(answer["error"])
        return answer

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.process.stdin.close()
            self.process.wait(timeout=10)
        if self.process.poll() is None:
            self.process.kill()


# Children kept warm (about 0.4 GB each): doctor --engine judges one tree, the tests many; the
# least recently asked one goes first.
KEEP_CHILDREN = 2
_children: collections.OrderedDict = collections.OrderedDict()


# What the class's behaviour can depend on, beside its own module: the switch's reader and the
# helper's home. Trees whose copies of these are byte for byte the same are observed once
# (spectpsync.observation keeps each answer under content_key).
_READS = (MODULE.replace(".", "/") + ".py", "sglang/srt/environ.py", "sglang/srt/utils/__init__.py",
          "sglang/srt/utils/common.py")


def content_key(tree: str, target: tuple = (MODULE, "SpecTpSync")) -> str:
    """A tree as the child would run its class: the content of the files that decide it
    (the class's own home among them) and which class it runs."""
    digest = hashlib.sha256(json.dumps(list(target)).encode())
    home = target[0].replace(".", "/") + ".py"
    for name in _READS + ((home,) if home not in _READS else ()):
        try:
            with open(os.path.join(tree, name), "rb") as handle:
                digest.update(handle.read())
        except OSError:
            digest.update(b"\0missing\0")
        digest.update(name.encode())
    return digest.hexdigest()


def observe_tree(tree: str, values, target: tuple = (MODULE, "SpecTpSync"), key: Optional[str] = None) -> dict:
    """The observation of the tree's class `target` ((module, name): the class the workers
    build) for `values`, made in a child interpreter kept per tree and content (`key`:
    content_key, computed here where not given). Unobservable where the class cannot run there."""
    tree = os.path.abspath(tree)  # the child runs in the tree's folder: a relative name would point elsewhere there
    place = (os.path.realpath(tree), key or content_key(tree, tuple(target)))
    child = _children.get(place)
    if child is None:
        while len(_children) >= KEEP_CHILDREN:
            _children.popitem(last=False)[1].close()
        child = _children[place] = _Child(str(tree))
    _children.move_to_end(place)
    return child.ask({"values": list(values), "target": list(target)})


@atexit.register
def close_children() -> None:
    for child in _children.values():
        child.close()
    _children.clear()


def _serve() -> None:
    """The child's loop: a JSON list of values in, an observation (or an error) out."""
    try:
        import importlib

        module = importlib.import_module(MODULE)
        tree = os.path.realpath(sys.argv[1])
        if not os.path.realpath(module.__file__).startswith(tree + os.sep):
            # e.g. a tree without sglang/__init__.py: another installation's package wins
            raise ImportError(f"{MODULE} came from {module.__file__}, not from the tree")
    except BaseException as exc:  # noqa: BLE001  (any failure to import is the answer)
        failure = f"the tree's {MODULE} cannot be imported here: {_error(exc)}"
        module = None
    for line in sys.stdin:
        if module is None:
            answer = {"error": failure}
        else:
            try:
                asked = json.loads(line)
                home, name = asked["target"]
                cls = getattr(importlib.import_module(home), name)
                answer = observe_module(module, asked["values"], cls=cls)
            except Exception as exc:  # noqa: BLE001
                answer = {"error": f"the class could not be run: {_error(exc)}"}
        sys.stdout.write(json.dumps(answer) + "\n")
        sys.stdout.flush()


if __name__ == "__child__":
    _serve()
