"""The fence's run-time guarantee, where a verify step's results leave the worker.

The fence's drift checks read the engine's sources: an early warning, not a proof.
`DSparkWorkerV2.forward_batch_generation` is where a step's results leave the worker
for the scheduler, whose overlapped readback may run after the next verify replay
rewrote the epilogue's persistent buffers. There, every tensor the result holds is
compared by storage with every tensor of the epilogue's memory, whatever the result's
shape: its fields and those of the objects, lists, tuples, dicts, slotted objects and
msgspec structs it holds, down to MAX_DEPTH levels. The epilogue's memory is walked the
same way (_map) and that map is tested by memory at each use (_fresh): a buffer
re-pointed in place is the same object over other memory, and an id is another
epilogue's once the first died. One that shares storage is copied there, on
the forward stream and before the next replay is queued, so the readback still reads
this step; and the route is named once per process, since the fence does not copy it
itself (0.5.23's default decode graph hands out its logits this way at every step).
A holder that cannot take the copy in place (a tuple, a frozen struct) is rebuilt and
handed to its own holder; the result itself, rebuilt, is what the worker returns.

The check never breaks a step: a shape it cannot walk, a holder it cannot rebuild, a
walk cut by its bounds (MAX_DEPTH, MAX_VALUES) is reported once, never raised.

Two walks, one verdict. The Python walk (`_walk`) copies, reports and learns new types
(holders.KINDS). Where the fence's kernel library is loaded (a GPU the prebuilt file
serves), its native scan looks first: one call that answers "clean" only where the
Python walk would find no route and report nothing (the same kinds, layouts, bounds and
skips), and "unsure" for anything it does not read exactly as the walk does (a type not
met yet, a tensor subclass, a list, tuple or dict subclass that reads otherwise, a
getattr that raises, a changed epilogue); the Python walk then runs as before. Once a scan
is bound, the wrapper itself runs in C too (`boundary_check`), and the worker's class holds
it with the engine's function inside (`boundary_method`, in place of wrapt's binding): a clean
step runs no Python of the pack's, and what is copied and said is the walk's alone.
Which check serves is said once, at the first check on a GPU; on the CPU the Python walk
serves and nothing is said. The scan reads CPython's object layout (a plain instance's inline
attributes and managed __dict__ word, PEP 509 dict versions), tried once per process by the
kernel file's self-checks (`layout()`): on a Python whose instances they do not read as expected
the Python walk serves, and the line says so; where dict versions do not follow every change
(3.13), the scan reads dicts in full. Pythons 3.11 to 3.13 are tested: bench/scan_pythons.sh.

One route is left where it is, never copied: the result's `logits_output.next_token_logits`, where
logits_readers shows from the engine's code that nothing reads it after the worker returns and the
rank's first steps with logits, copied and watched, saw no read (0.5.23's decode graph hands out its
logits this way at every step: copying them was most of the served step's cost). Only that route, of
the result's own type holding that logits output's type: the same tensor held anywhere else is copied.

Cost: one look at each value the result holds and one storage lookup per tensor, and
one look at each value and tensor of the map, every step (figures in docs/performance.md).
"""

from __future__ import annotations

import functools
import operator
import platform
import weakref

import torch

from . import accept_snapshot, holders, logits_readers
from ..framework import log, metrics, patching

MAX_DEPTH = 4      # the result's own fields are level 1: a view two objects down is level 3
MAX_VALUES = 256   # tensors and holders looked at per step, at most (a DSpark decode result: about 15)
MAP_VALUES = 2048  # tensors and holders of the epilogue's own memory mapped, at most (static_io: 8 a captured size)

_said: set = set()     # what was already reported in this process
# id(epilogue) -> its memory map: (owner, nodes, (tensors, their storages' addresses), storage map, native scan
# or None, route -> object followed, routes whose object had changed). owner is a weak reference to the
# epilogue (an id reused after it died finds it dead); the map serves only while _fresh says the
# epilogue's memory is as it was walked.
_storages: dict = {}
# the types down a path the scan found -> (the keys down it, the route, the keys found, their addresses, routes)
_plans: dict = {}
_KINDS, _kind = holders.KINDS, holders.kind
_LEAF, _TENSOR, _SEQUENCE, _MAPPING = holders.LEAF, holders.TENSOR, holders.SEQUENCE, holders.MAPPING
_FREE = object()       # a map's slot where a leaf or a tuple of leaves was: any such value may take its place
_BEYOND = object()     # a map's slot where a holder past MAX_DEPTH was: anything but a tensor may take its place
_ANY = object()        # a map's slot that holds the step's results (REFERENCES): anything may take its place
# Attributes in the epilogue's memory that hold the step's results, not memory of its own (by the holder's
# type name): 0.5.23's FutureRelayBuffers keeps the step's accept outputs (the fence's copies, which the
# result leaving the worker holds too) for FutureMap.publish / stash to recognise by identity.
REFERENCES = frozenset({("FutureRelayBuffers", "published_seq_lens"), ("FutureRelayBuffers", "published_bonus")})
_PROBE = object()      # not known yet: found at the first check on a GPU
_native = _PROBE       # the kernel library whose native scan serves, None: the Python walk alone
_native_check = None   # check_results in C, once a scan is bound (the library serves)
EPILOGUE = "_verify_epilogue"  # the worker's attribute that holds the verify graph's epilogue


def reset() -> None:
    """Forget the routes already reported and the epilogues' storage maps (tests)."""
    _said.clear()
    _storages.clear()
    _plans.clear()


def use_native(library=_PROBE) -> None:
    """Which check serves (tests, benchmarks): `library`'s native scan (a loaded kernel
    library), None for the Python walk alone, or by default what the first check on a GPU finds."""
    global _native, _native_check
    _native, _native_check = library, None
    patching.bind_faster(check_results)  # wrapt's binding again until a scan is bound
    _storages.clear()


def check_mode() -> str:
    """"native" where the native scan serves the clean steps, else "python"."""
    return "python" if _library() is None else "native"


def _library():
    """The loaded kernel library, or None. Found at the first check made while CUDA is up
    (the rank's own device is current then): the copy's mode is probed, if the fence's
    first CUDA result has not done it, and both are said once."""
    global _native
    if _native is _PROBE and torch.cuda.is_initialized():
        library = accept_snapshot.probed_extension()
        _native = library if library is None or library.layout()["plain_reads"] else None
        say_once("check", f"boundary check: native scan ({library.__file__})" if _native is not None else
                          f"boundary check: the Python walk (no kernel library: {accept_snapshot.copy_mode()[1]})"
                          if library is None else f"boundary check: the Python walk (the native scan does not know "
                                                  f"how Python {platform.python_version()} lays out an instance)")
    return None if _native is _PROBE else _native


def check_results(wrapped, instance, args, kwargs):
    """The wrapper on the worker's return. Once the native scan serves, its C form
    (`boundary_check` in the kernel file) does all of this and hands `_checked` only what
    the scan is unsure of: a clean step runs no Python here."""
    if _native_check is not None:
        return _native_check(wrapped, instance, args, kwargs)
    result = wrapped(*args, **kwargs)
    epilogue = getattr(instance, EPILOGUE, None)
    if epilogue is None or result is None or result is epilogue:
        return result
    return _checked(result, epilogue)


def _checked(result, epilogue, found=None):
    """check_results' rest: `found` is what the native scan answered, where it ran (False: unsure;
    a list: the tensors that share the epilogue's storages, all the walk would find)."""
    try:
        if found is None:
            scan = (_storages.get(id(epilogue)) or _cache(epilogue))[4]  # detach_escapes' first look, inline
            found = False if scan is None else scan(result, epilogue)
        if found is True:
            checked = result
        elif found and (copied := _copied(result, found, epilogue)) is not None:
            checked = copied
        else:
            checked = _walk(result, epilogue)[0]
        if logits_readers.watching():
            logits_readers.watch(checked)
        return checked
    except Exception as exc:  # noqa: BLE001 - never break a step; said once
        say_once(("failed", type(result)), f"boundary: could not check a {type(result).__name__} leaving the worker "
                                           f"({type(exc).__name__}: {exc}); its tensors were not compared with the verify graph's buffers")
        return result


def persistent_storages(epilogue) -> dict:
    """Storage address -> where the epilogue holds it ("Epilogue.name", "Epilogue.static_io[8].seq_lens"),
    for every tensor of its memory: its attributes and what they hold, walked as results are
    (as _held reads them, breadth first, MAX_DEPTH levels, at most MAP_VALUES values)."""
    return _cache(epilogue)[3]


def _cache(epilogue) -> tuple:
    cached = _storages.get(id(epilogue))
    if cached is None or (cached[4] is None and _native is _PROBE and torch.cuda.is_initialized()):  # built before CUDA was up
        return _map(epilogue, cached)
    # the scan of nothing answers whether the map still holds, in C; where it is unsure, _fresh decides
    if (cached[4] is not None and cached[4](None, epilogue) is True) or _fresh(cached, epilogue):
        return cached
    return _map(epilogue, cached)


def _fresh(cached: tuple, epilogue) -> bool:
    """Whether the map still describes the epilogue's memory: the same epilogue, every holder
    walked holding what it held (the same objects where the map follows them), every tensor
    over the storage it had. Checked at every use: a buffer re-pointed in place (set_,
    .data =, a resize_ that moves it) is the same object over other memory."""
    owner, nodes, (tensors, addresses) = cached[0], cached[1], cached[2]
    if _owner(owner) is not epilogue:
        return False
    try:
        for holder, slots, values in nodes:
            values = values(epilogue if holder is None else holder)
            if len(values) != len(slots) or not all(map(_same, values, slots)):
                return False
        return list(map(_STORAGE_ADDRESS, map(_STORAGE, tensors))) == addresses
    except Exception:  # noqa: BLE001 - a holder that cannot be read now, a tensor that lost its storage: walk again
        return False


def _held(holder) -> list:
    """(key, value) for what a holder of the epilogue's memory holds: a list's, tuple's or
    dict's own storage whatever its type (a subclass may show it otherwise or in another
    order, an OrderedDict of nn.Module's hooks, but holds that), else holders.items."""
    if isinstance(holder, list):
        return list(enumerate(list.__iter__(holder)))
    if isinstance(holder, tuple):
        return list(enumerate(tuple.__iter__(holder)))
    if isinstance(holder, dict):
        return list(dict.items(holder))
    return list(holders.items(holder))


def _values(holder):
    """How _fresh reads a holder's values: as _held gives them, without their keys."""
    tp = type(holder)
    if tp is list or tp is tuple:
        return _itself
    if isinstance(holder, list):
        return list.copy
    if isinstance(holder, tuple):
        return _tuple_items
    if isinstance(holder, dict):
        return dict.values
    names, has_dict = holders.layout(tp) if _kind(tp) is holders.HOLDER else ((), False)
    if not names and has_dict:
        return _attributes
    if len(names) > 1 and not has_dict and names == tuple(getattr(tp, "__struct_fields__", ())):
        return operator.attrgetter(*names)  # a msgspec struct: every field always set, read in one call
    return _read


def _itself(holder):
    return holder


def _tuple_items(holder):
    return tuple(tuple.__iter__(holder))


def _attributes(holder):
    return vars(holder).values()


def _read(holder):
    return [value for _, value in holders.items(holder)]


def _same(value, slot) -> bool:
    """`value` takes the place of what the map found there: the very object where the map
    follows it; where it did not, any value it would not follow either."""
    if value is slot or slot is _ANY:
        return True
    if slot is _FREE:
        return _free(value)
    return slot is _BEYOND and (_KINDS.get(type(value)) or _kind(type(value))) is not _TENSOR


def _free(value) -> bool:
    """A leaf, or a tuple of leaves (per-step state such as (bs, armed)): it holds no memory."""
    if type(value) is tuple:
        return all((_KINDS.get(type(v)) or _kind(type(v))) is _LEAF for v in value)
    return (_KINDS.get(type(value)) or _kind(type(value))) is _LEAF


def _address(tensor) -> int:
    return tensor.untyped_storage().data_ptr()


_STORAGE, _STORAGE_ADDRESS = torch.Tensor.untyped_storage, torch.UntypedStorage.data_ptr  # _address, mapped without a frame


def _owner(owner):
    return owner() if type(owner) is weakref.ReferenceType else owner


def _map(epilogue, before: tuple = None) -> tuple:
    """Walk the epilogue's memory as _walk walks a result (breadth first, MAX_DEPTH levels;
    what each holder holds as _held reads it) and bind the native scan to it. Each holder walked is a node: its
    slots are the values it held (as _values reads them), or _FREE (a leaf or a tuple of
    leaves), _BEYOND (a holder past MAX_DEPTH) and _ANY (REFERENCES) where the map does not
    follow them. A holder is mapped whole or not at all, up to MAP_VALUES values; what is
    left out is said once, and so is a route whose object changed at two walks in a row
    (`before`: the last map)."""
    name = type(epilogue).__name__
    queue, nodes, tensors, addresses, storages, routes = [(None, 1, name)], [], [], [], {}, {}
    seen, left, cut = {id(epilogue)}, MAP_VALUES, None
    for holder, level, where in queue:
        here = epilogue if holder is None else holder
        try:
            found = _held(here)
        except Exception as exc:  # noqa: BLE001 - not mapped, said; its own holder still watches it
            say_once(("map", where), f"boundary: could not read {where} ({type(exc).__name__}: {exc}); "
                                     "the tensors it holds are not compared with results")
            continue
        owner = type(here).__name__
        slots = [_ANY if (owner, key) in REFERENCES else _FREE if _free(value) else value for key, value in found]
        held = sum(1 for slot in slots if slot is not _FREE and slot is not _ANY)  # by identity: == on a tensor is elementwise
        if held > left and holder is not None:
            cut = cut or where
            continue
        left -= held
        for at, (key, value) in enumerate(found):
            if slots[at] is _FREE or slots[at] is _ANY or value is epilogue:
                continue
            routes[_route(where, here, key)] = value
            if _kind(type(value)) is _TENSOR:
                if id(value) in seen:
                    continue
                seen.add(id(value))
                try:
                    address = _address(value)
                except Exception:  # noqa: BLE001 - no storage (sparse, nested): nothing a result can share
                    continue
                tensors.append(value)
                addresses.append(address)
                if value.numel():
                    storages.setdefault(address, _route(where, here, key))
            elif level >= MAX_DEPTH:
                slots[at] = _BEYOND
                cut = cut or _route(where, here, key)
            elif id(value) not in seen:
                seen.add(id(value))
                queue.append((value, level + 1, _route(where, here, key)))
        nodes.append((holder, tuple(slots), _values(here)))
    if cut is not None:
        say_once(("map cut", name), f"boundary: {name}'s memory is mapped {MAX_DEPTH} levels down and {MAP_VALUES} "
                                    f"values wide; {cut} and what lies beyond it are not compared with results")
    moved = set() if before is None or _owner(before[0]) is not epilogue else \
        {route for route, value in routes.items() if before[5].get(route, value) is not value}
    for route in sorted(moved & before[6]) if moved else ():
        say_once(("moving", route), f"boundary: {route} holds another object at each check, so {name}'s memory "
                                    "is walked again each time (if it holds the step's results, not memory of its "
                                    "own, it belongs in fence_boundary.REFERENCES)")
    try:
        owner = weakref.ref(epilogue, functools.partial(_forget, _storages, id(epilogue)))
    except TypeError:  # no weak references to it: held, so its id is not reused while mapped
        owner = epilogue
    library, leave = _library(), _leaving()
    scan = None if library is None else library.boundary_scan(  # bound once: the same test of this map's freshness
        holders.KINDS, holders._layouts, (holders.LEAF, holders.TENSOR, holders.SEQUENCE, holders.MAPPING, holders.HOLDER),
        (torch.Tensor, torch.nn.Parameter), owner, (_FREE, _BEYOND, _ANY), nodes, tensors, addresses,
        list(storages), MAX_DEPTH, MAX_VALUES, leave and (*leave, logits_readers.HOLDER, logits_readers.LOGITS_FIELD))
    _storages.pop(id(epilogue), None)  # the newest last
    cached = _storages[id(epilogue)] = (owner, nodes, (tuple(tensors), addresses), storages, scan, routes, moved)
    while len(_storages) > 8:  # epilogues kept alive by a cycle through their map: the oldest go
        _storages.pop(next(iter(_storages)))
    if scan is not None and not logits_readers.watching():  # while watching, every step passes _checked
        _serve_native(library)
    return cached


def _leaving():
    """(result type, logits type) whose logits route is left in place, or None (logits_readers)."""
    try:
        return logits_readers.leaving()
    except Exception:  # noqa: BLE001 - no decision: everything is copied
        return None


def _left(queue: list, at: int, key) -> bool:
    """The walk's form of the scan's rule: the tensor at `key` of the holder at `at` is the
    result's logits_output.next_token_logits, of the types logits_readers left in place."""
    leave = _leaving()
    if leave is None or key != logits_readers.LOGITS_FIELD:
        return False
    holder, level, parent, held_at = queue[at]
    return (level == 2 and parent == 0 and held_at == logits_readers.HOLDER and type(queue[0][0]) is leave[0]
            and type(holder) is leave[1])


def _remap() -> None:
    """What is left in place changed: every map is made again, its scan bound to the new rule."""
    _storages.clear()
    _plans.clear()


logits_readers.when_changed(_remap)


def _forget(maps: dict, key: int, owner) -> None:
    """The epilogue died: its map (and the buffers it holds) goes, unless one for a new epilogue took its place."""
    cached = maps.get(key)
    if cached is not None and cached[0] is owner:
        del maps[key]


def _serve_native(library) -> None:
    global _native_check
    if _native_check is None:  # reads this very map (never rebound: reset() clears it in place)
        _native_check = check = library.boundary_check(_storages, _checked, EPILOGUE, _plans, _said_copy)
        # the worker's method with that check in it: what wrapt's binding of check_results does,
        # without wrapt's hop and check_results' frame
        patching.bind_faster(check_results, patching.for_functions(lambda original: library.boundary_method(original, check)))


def detach_escapes(result, epilogue) -> tuple[object, list[str]]:
    """(`result` with every tensor that shares storage with the epilogue's buffers copied,
    the routes found as "Holder.field <- Epilogue.buffer"). The result is the same object
    unless it had to be rebuilt (a tuple, a frozen struct). The native scan first, where
    it serves: clean means the Python walk would find and say nothing."""
    scan = (_storages.get(id(epilogue)) or _cache(epilogue))[4]
    if scan is not None and scan(result, epilogue) is True:
        return result, []
    return _walk(result, epilogue)


def _copied(result, found: list, epilogue):
    """`result` with the native scan's finds copied in place, each route counted and said as
    _walk says it (the scan finds them where the walk would, and nothing else); None where
    one cannot be (a tuple holds one, a holder refuses it, anything raised): the walk then serves."""
    try:
        planned = [(holder, where, {key: tensor.clone() for key, tensor in kept}, routes, plan)
                   for holder, where, kept, routes, plan in shared_routes(found, epilogue)]
    except Exception:  # noqa: BLE001 - the walk finds them again, and says what it cannot do
        return None
    for holder, where, changes, routes, plan in planned:
        if _put(holder, changes, where) is not None:  # refused in place and rebuilt: the walk puts that up
            return None
        if plan is not None and (plan[0] in _plans or len(_plans) < 64):  # kept once set in place: the C check reads it
            _plans[plan[0]] = plan[1]
        for route in routes:
            _said_copy(route)
    return result


def shared_routes(found: list, epilogue) -> list:
    """What the native scan found, by holder: (the holder, the route to it, [(key, tensor)] for
    each place it keeps a tensor over the epilogue's storages, the routes as _walk names them,
    (the types down its path, what _plans is to keep for them) where it found the keys anew, else
    None); raises where a tuple holds one (it cannot take a copy in place) or a holder reads otherwise."""
    storages = _storages[id(epilogue)][3]  # the map the scan just found holding
    by_holder = {}  # id(holder) -> (the path to it, id(tensor) -> its storage's address, how many found there)
    for path, tensor, address in found:
        if isinstance(path[-1], tuple):
            raise TypeError("a tuple holds it")
        entry = by_holder.setdefault(id(path[-1]), (path, {}, []))
        entry[1][id(tensor)] = address
        entry[2].append(address)
    return [(path[-1], *_kept(path, addresses, len(places), storages))
            for path, addresses, places in by_holder.values()]


def _kept(path: tuple, addresses: dict, count: int, storages: dict) -> tuple:
    """(the route to path's last holder, [(key, tensor)] for the `count` places it keeps the tensors
    of `addresses` (id -> storage address) in, their routes, the plan to keep or None). Found by
    reading each holder as the walk does, and kept by the types down the path (by _copied, once the
    copies were taken in place): the next step's new objects are then read at those keys only, and
    found again where any differs."""
    types = tuple(map(type, path))
    known = _plans.get(types)
    if known is not None and len(known[2]) == count:
        try:
            same = True
            for outer, key, inner in zip(path, known[0], path[1:]):
                same = same and _at(outer, key) is inner
            kept = [(key, _at(path[-1], key)) for key in known[2]] if same else ()
            if same and all(id(held) in addresses for _, held in kept):
                if known[3] == [addresses[id(held)] for _, held in kept]:
                    return known[1], kept, known[4], None
                routes = _routes(known[1], path[-1], kept, addresses, storages)
                return known[1], kept, routes, (types, (*known[:3], [addresses[id(held)] for _, held in kept], routes))
        except Exception:  # noqa: BLE001 - read otherwise now: found again below
            pass
    keys = [next(key for key, held in holders.items(outer) if held is inner) for outer, inner in zip(path, path[1:])]
    where = type(path[0]).__name__
    for outer, key in zip(path, keys):
        where = _route(where, outer, key)
    kept = [(key, held) for key, held in holders.items(path[-1]) if id(held) in addresses]
    if len(kept) != count:
        raise LookupError(f"{where} holds {len(kept)} of the {count} tensors the scan found there")
    routes = _routes(where, path[-1], kept, addresses, storages)
    found_at = [addresses[id(held)] for _, held in kept]
    return where, kept, routes, (types, (keys, where, [key for key, _ in kept], found_at, routes))


def _routes(where: str, holder, kept: list, addresses: dict, storages: dict) -> list:
    return [f"{_route(where, holder, key)} <- {storages[addresses[id(held)]]}" for key, held in kept]


def _at(holder, key):
    """What `holder` keeps at `key` (as holders.items gives it: an index, a dict's key, a name)."""
    if isinstance(holder, list):  # the scan reads a list or tuple by the base type's own iterator
        return list.__getitem__(holder, key)
    if isinstance(holder, tuple):
        return tuple.__getitem__(holder, key)
    if type(holder) is dict:  # the scan reads no other mapping
        return holder[key]
    return getattr(holder, key)


def _walk(result, epilogue) -> tuple[object, list[str]]:
    """detach_escapes in Python. Breadth first, so that a long list deep down cannot use up
    the budget before the result's own fields are looked at: `queue` holds (holder, level,
    index of its own holder in the queue, its key there); routes are spelled out only when
    said; the copies are put back deepest first."""
    storages = persistent_storages(epilogue)
    queue, changes, routes, left, at = [(result, 1, -1, None)], {}, [], MAX_VALUES, 0
    while at < len(queue) and left >= 0:
        holder, level, _, _ = queue[at]
        try:
            for key, value in holders.items(holder):
                if value is None:
                    continue
                what = _KINDS.get(type(value)) or _kind(type(value))
                if what is _LEAF or value is epilogue:
                    continue
                left -= 1
                if left < 0:
                    where = _where(queue, at)
                    say_once(("cut", where), f"boundary: stopped at {where} after {MAX_VALUES} values; "
                                             "what lies beyond was not compared with the verify graph's buffers")
                    break
                if what is _TENSOR:
                    try:
                        buffer = storages.get(value.untyped_storage().data_ptr())
                    except Exception:  # noqa: BLE001 - no storage to share (sparse, nested): nothing to copy
                        continue
                    if buffer is not None and not _left(queue, at, key):
                        changes.setdefault(at, {})[key] = value.clone()
                        routes.append(f"{_route(_where(queue, at), holder, key)} <- {buffer}")
                elif level < MAX_DEPTH:
                    queue.append((value, level + 1, at, key))
                else:
                    deep = _route(_where(queue, at), holder, key)
                    say_once(("deep", deep), f"boundary: {deep} ({type(value).__name__}) lies deeper than {MAX_DEPTH} "
                                             "levels and was not compared with the verify graph's buffers")
        except Exception as exc:  # noqa: BLE001 - a shape that cannot be walked is said, not raised
            where = _where(queue, at)
            say_once(("walk", where, type(holder)), f"boundary: could not walk {where} ({type(holder).__name__}: "
                                                    f"{type(exc).__name__}: {exc}); the rest of it was not compared")
        at += 1
    for at in reversed(range(len(queue))):  # a holder's index is below its values'
        if at not in changes:
            continue
        holder, _, parent, key = queue[at]
        fresh = _put(holder, changes[at], _where(queue, at))
        if fresh is not None and parent >= 0:
            changes.setdefault(parent, {})[key] = fresh
        elif fresh is not None:
            result = fresh
    for route in routes:
        _said_copy(route)
    return result, routes


def _said_copy(route: str) -> None:
    metrics.count_boundary_copy(route)  # every copy, every step: /metrics keeps what log rotation drops
    say_once(route, f"boundary: {route} shared the verify graph's buffers; copied where it leaves the worker, "
                    "at each step it does (a route the fence does not copy itself: docs/adapters.md lists the "
                    "known ones; please report any other)")


def _where(queue: list, at: int) -> str:
    """The route to the holder at `at` in the walk's queue, from the result's type down."""
    holder, _, parent, key = queue[at]
    return type(holder).__name__ if parent < 0 else _route(_where(queue, parent), queue[parent][0], key)


def _route(where: str, holder, key) -> str:
    """The route to a value, as reported: sequence items are one route whatever the index."""
    what = _kind(type(holder))
    return f"{where}[]" if what is _SEQUENCE else f"{where}[{key!r}]" if what is _MAPPING else f"{where}.{key}"


def _put(holder, changes: dict, where: str):
    """The copies put in place; a holder that refuses that (a tuple, a frozen struct) is
    rebuilt, and the rebuilt one returned for its own holder to take."""
    if not isinstance(holder, tuple):
        try:
            for key, value in changes.items():
                if isinstance(holder, (list, dict)):
                    holder[key] = value
                else:
                    setattr(holder, key, value)
            return None
        except Exception:  # noqa: BLE001 - refused in place: rebuilt below
            pass
    try:
        return holders.replaced(holder, changes)
    except Exception as exc:  # noqa: BLE001 - said, never raised
        say_once(("put", where, type(holder)), f"boundary: could not replace the copies in {where} "
                                               f"({type(holder).__name__}: {type(exc).__name__}: {exc}); it still shares the buffers")
        return None


def say_once(key, text: str) -> None:
    if key not in _said:
        _said.add(key)
        log.emit(f"folded_fence {text}", adapter="folded_fence")
