"""Per-site divergence counters on the device, and their report (what tp_divergence's
wrappers call).

At a broadcast site each rank keeps the value it computed (`copies`, before an in-place
broadcast; a packed broadcast leaves the inputs as they were), lets the broadcast
overwrite it with rank 0's, and `observe` adds to that site's row of a counter tensor on
the value's device: [calls, calls that differed, elements that differed]. Only device ops:
no host synchronisation and no collective, so it records into a captured CUDA graph and
counts on every replay. The counter tensor is allocated at the first call outside graph
capture (sglang warms every captured region up eagerly first); a first call inside a
capture is refused, since a tensor made there would be zeroed by every replay.

On CUDA, where the pack's compiled kernel library serves (spectpsync.library), a site
call costs one fused launch (`count_divergence`: every (mine, theirs) pair compared bit
for bit per element of the field's size, which is `ne` for the integer and bool values
these sites broadcast, and [1, min(e, 1), e] added to the site's row). At the engine's
SpecTpSync.sync a rank other than 0 receives rank 0's value into a tensor of its own, and
the same launch copies it into the caller's where they differ (`settle`); rank 0 sends its
own. The pack's own broadcast does the same for a site of one tensor; a packed site leaves
the inputs as they were, and several tensors broadcast in place are copied first
(`snapshot`: one more launch). Elsewhere (the CPU, no
kernel file, values it cannot take) torch ops serve: ne, sum, clamp and one add per call
(and a clone or a copy per value), five to eight launches. Which one serves CUDA values is
said once per process.

With abort off, the wrapper tp_divergence puts on the engine's SpecTpSync.sync has a C form
in the kernel library (`report_sync`, bound at the first call the library serves: with_c_form):
the common eager call (the site labelled, the device's counters made, a contiguous CUDA value)
is read, broadcast, counted and added to `_calls` there, as the Python form would, and
`_after_count` gets what it does not do itself (a read due or in flight, a first call, values
the kernel declines).

Every `every` calls made from Python (a captured site replays without Python, so its
replays reach the report at the next eager call), each device's counters are copied to
pinned host memory without waiting; the copy is printed once it has landed: one line
per site that diverged since the last report. At interpreter exit the rest is printed.
With the engine's metrics on (adapter.framework.metrics) the same counts also go to the counters
sglang_adapters:tp_divergence_calls_total, _diverged_calls_total, _diverged_elements_total.

With `abort` (DSV41_TP_DIVERGENCE=abort) a site call also records, with torch ops on the
device, the site's first diverging call: its number, the first differing element and both
values (`firsts`); and every eager call starts a read and looks at the copy that has landed
(on the CPU at once; on CUDA once the copy lands, usually at the next eager call). On a
diverged count it prints one line and raises `Diverged`, which ends the scheduler process
through the engine's own path for an exception (module adapter.tp_divergence). A captured
site replays without Python: its divergence stops the rank at the next eager call after the
copy that holds it lands. `dump` is what the engine's watchdog prints on a hang: the last
landed copy, nothing asked of the device.
"""

from __future__ import annotations

import atexit
from typing import Optional

from ..framework import log, metrics
from ..spectpsync import library

PREFIX = log.PREFIX
ABORT_FLAG = "DSV41_TP_DIVERGENCE=abort"
ROWS = 32  # site numbers index the rows (upstream's run 1-17)
CALLS, DIVERGED_CALLS, DIVERGED_ELEMENTS = range(3)
STEP, ELEMENT, MINE, THEIRS = range(4)  # a row of `firsts`: the site's first diverging call
METRICS = (("calls", "calls of a rank-0 broadcast site with the divergence report on"),
           ("diverged_calls", "calls where this rank's own value differed from rank 0's"),
           ("diverged_elements", "elements where this rank's own value differed from rank 0's"))
METRIC_PREFIX = metrics.PREFIX + "tp_divergence_"


class Tally:
    """One device's counters, and the host copy a report reads without waiting."""

    def __init__(self, device):
        import torch

        self.device = device
        self.counts = torch.zeros(ROWS, 3, dtype=torch.int64, device=device)
        # One call's row is clamp(diverged elements, floor, ceiling) = [1, min(e, 1), e]:
        # one kernel instead of a stack of three.
        self.floor = torch.tensor([1, 0, 0], dtype=torch.int64, device=device)
        self.ceiling = torch.tensor([1, 1, torch.iinfo(torch.int64).max], dtype=torch.int64, device=device)
        cuda = device.type == "cuda"
        self.host = torch.zeros(ROWS, 3, dtype=torch.int64, pin_memory=cuda)
        self.event = torch.cuda.Event() if cuda else None
        self.reported = torch.zeros(ROWS, 3, dtype=torch.int64)  # totals already reported
        self.in_flight = False
        self.firsts = torch.zeros(ROWS, 4, dtype=torch.int64, device=device)  # written with abort only
        self.host_firsts = torch.zeros(ROWS, 4, dtype=torch.int64, pin_memory=cuda)
        self.landed_firsts = torch.zeros(ROWS, 4, dtype=torch.int64)  # as of the last landed read
        self.read_at = self.landed_at = 0  # observe() calls made when the (last landed) read started

    def start_read(self) -> None:
        self.host.copy_(self.counts, non_blocking=True)
        self.host_firsts.copy_(self.firsts, non_blocking=True)
        self.read_at = _calls
        if self.event is not None:
            self.event.record()
        self.in_flight = True

    def landed(self) -> bool:
        return self.event is None or self.event.query()


_tallies: dict = {}  # device index (-1: the CPU) -> Tally
_slugs: dict[int, str] = {}  # site number -> slug, as the engine (or the pack) names it
_calls = 0  # observe() calls made from Python, every site
_started = False
_reading = False  # a read of some device's counters is in flight
_kernel = None  # the kernel library where it serves CUDA values, False for torch ops; None: undecided
_use_kernel = True  # use_kernel() (tests, benchmarks)
_use_c_form = True  # use_c_form() (benchmarks)
_said_torch: set = set()  # sites whose values the fused kernel could not take, said once each
_labels: dict = {}  # id(site member) -> (number, slug): Enum's .name costs about a microsecond per read
_labelled: list = []  # those members, held: an id in _labels is never another object's (report_sync reads it too)
_abort = False  # the last call's setting: stop at the first divergence seen
_last_diverged: Optional[int] = None  # the site whose diverged count grew in the latest landed read
_stopped: Optional[str] = None  # the abort's line, once raised: every later site call raises it before its broadcast


class Diverged(RuntimeError):
    """This rank's value differed from rank 0's at a compared site, with DSV41_TP_DIVERGENCE=abort."""


def label(site) -> tuple[int, str]:
    """(number, slug) of a site (the engine's SpecTpSyncSite or the pack's Site member), read once."""
    found = _labels.get(id(site))  # by identity: two enums may number the same site differently
    if found is None:
        found = _labels[id(site)] = (int(site), site.slug)
        _labelled.append(site)
    return found


def use_kernel(enabled: bool) -> None:
    """Compare CUDA values with the kernel library where it serves (the default), or with
    torch ops (tests and benchmarks compare both); decided again, and said, at the next call."""
    global _use_kernel, _kernel
    _use_kernel, _kernel = bool(enabled), None


def compare_mode() -> tuple[str, str]:
    """("fused kernel", the kernel file) or ("torch ops", why) for CUDA values. The first
    call loads the kernel file (a dlopen, no compile: spectpsync.library)."""
    return library.serving(_use_kernel, "fused kernel", "torch ops")[:2]


def _decide_kernel():
    global _kernel
    mode, detail, kernel = library.serving(_use_kernel, "fused kernel", "torch ops")
    _kernel = kernel if kernel is not None else False
    # Probed at the first CUDA call, on the rank's own device; one line says which serves.
    log.emit(f"tp_divergence compare: {mode} - {detail}", adapter="tp_divergence", compare=mode, detail=detail)
    return _kernel


def copies(tensors) -> list:
    """This rank's own values, kept before a broadcast overwrites them in place: on CUDA
    one launch into one block for all of them where the kernel library serves, else clones."""
    if tensors[0].is_cuda:
        kernel = _kernel if _kernel is not None else _decide_kernel()
        if kernel:
            return kernel.snapshot(tensors)
    return [t.clone() for t in tensors]


def receiver(value):
    """A contiguous tensor like `value` for rank 0's value to be received into, then read by
    observe(..., settle=True) on the same stream: on CUDA where the kernel library serves, one
    block per stream kept from call to call (fresh inside graph capture), else new_empty."""
    if value.is_cuda:
        kernel = _kernel if _kernel is not None else _decide_kernel()
        if kernel:
            return kernel.receive(value)
    return value.new_empty(value.shape)


def calls() -> int:
    """observe() calls made from Python in this process, every site (a replayed graph makes none)."""
    return _calls


def _capturing(tensor) -> bool:
    import torch

    return tensor.is_cuda and torch.cuda.is_current_stream_capturing()


def _tally(device, capturing: bool, label: str) -> Tally:
    """The counters of `device`, made at its first call (outside capture). Keyed by the
    device's index (-1: the CPU), which a tensor gives cheaper than its device object."""
    index = device.index if device.type == "cuda" else -1
    tally = _tallies.get(index)
    if tally is None:
        if capturing:
            raise RuntimeError(
                f"tp_divergence: site {label} first ran inside CUDA graph capture on {device}; its counters must "
                f"exist before capture (a warm-up call outside capture makes them): switch DSV41_TP_DIVERGENCE off")
        tally = _tallies[index] = Tally(device)
    return tally


def observe(number: int, slug: str, mine, theirs, every: int, abort: bool = False, settle: bool = False) -> None:
    """Count one call of site `number`: `mine` the values this rank computed, `theirs`
    rank 0's (the same tensors after an in-place broadcast, with `mine` kept before it; or,
    with `settle`, received apart: then rank 0's are copied into `mine` in the same launch).
    With `abort`, raise Diverged at the first divergence a landed read shows."""
    global _abort
    first = mine[0]  # on the device of theirs (received apart, or the same tensors)
    tally = _tallies.get(first.get_device())  # a GPU's index, -1 on the CPU
    if tally is None:
        tally = _tally(first.device, _capturing(first), f"{number}:{slug}")
    _abort = abort
    if abort:  # before the count: the call's number is the count so far plus one
        _record_first(tally, number, mine, theirs)
    kernel = (_kernel if _kernel is not None else _decide_kernel()) if first.is_cuda else False
    if not (kernel and (kernel.count_pair(first, theirs[0], tally.counts, number, settle) if len(mine) == 1
                        else kernel.count_divergence(mine, theirs, tally.counts, number, settle))):
        if kernel and number not in _said_torch:
            _said_torch.add(number)
            log.emit(f"tp_divergence compare: site {number}:{slug} with torch ops - the fused kernel takes up to 8 "
                     "contiguous values of 1, 2, 4 or 8-byte elements on one GPU", adapter="tp_divergence",
                     site=f"{number}:{slug}")
        _count_with_torch(tally, number, mine, theirs)
        if settle:
            for own, received in zip(mine, theirs):
                own.copy_(received)
    _count_call(number, slug, first, every, abort)


def _count_call(number: int, slug: str, first, every: int, abort: bool) -> None:
    """What observe does once a call is counted: the call added, and a read started or
    looked at where one is due or in flight."""
    global _calls, _started
    _slugs.setdefault(number, slug)
    if not _started:  # the rank, fixed now: at exit the process group may be gone
        _started = True
        log.set_process_label(log.process_label())
        atexit.register(flush)
    _calls += 1
    # Asked only where a read is due or in flight (torch's capture query costs host time at
    # every call): no copy or event query may be recorded into a graph.
    due = abort or _calls % every == 0
    if (_reading or due) and not _capturing(first):
        if _reading:
            _print_landed()
        if due:
            _start_reads()
            _print_landed()
        if abort:
            _stop_if_diverged()


def with_c_form(around_sync, every: int):
    """tp_divergence's wrapper of SpecTpSync.sync (`around_sync`, abort off) with its common
    eager call in C once the kernel library serves this process (its `report_sync`): the call
    around_sync would make with the library, the site labelled and the device's counters
    made, the value a contiguous CUDA tensor; it reads this module's state as around_sync
    does and hands back to `_after_count` what it does not do itself. Every other call is
    around_sync's."""
    native = None

    def around_sync_in_c(wrapped, instance, args, kwargs):
        nonlocal native
        if native is not None and _use_c_form:
            return native(wrapped, instance, args, kwargs)
        result = around_sync(wrapped, instance, args, kwargs)
        if native is None and _kernel:  # decided at the first CUDA call: the library serves
            native = _kernel.report_sync(around_sync, globals(), _kernel, _after_count, every)
        return result

    return around_sync_in_c


def use_c_form(enabled: bool) -> None:
    """Run the C form of tp_divergence's wrapper where it serves (the default), or the Python
    form alone (benchmarks compare both)."""
    global _use_c_form
    _use_c_form = bool(enabled)


def _after_count(number: int, slug: str, mine, theirs, settle: bool, every: int) -> None:
    """report_sync's way back: with `theirs`, the whole count (observe: sync returned no
    tensor, or the fused kernel declined the values); with None, what observe does once the
    kernel counted the call."""
    if theirs is not None:
        observe(number, slug, (mine,), (theirs,), every, False, settle)
    else:
        _count_call(number, slug, mine, every, False)


def _count_with_torch(tally, number, mine, theirs) -> None:
    import torch

    differed = [torch.ne(a, b).sum() for a, b in zip(mine, theirs)]
    elements = differed[0] if len(differed) == 1 else torch.stack(differed).sum()
    tally.counts[number].add_(torch.clamp(elements, tally.floor, tally.ceiling))


def _record_first(tally, number, mine, theirs) -> None:
    """Device ops only: where this call differs and the site has not diverged before, its
    row of `firsts` becomes [call number, first differing element, mine, rank 0's] (as
    int64, over the values flattened one after another)."""
    import torch

    if not sum(t.numel() for t in theirs):
        return
    own, zero = _flat(mine), _flat(theirs)
    differ = own.ne(zero)
    at = differ.to(torch.uint8).argmax().view(1)  # the first differing element (0 where none)
    row = torch.cat([tally.counts[number, CALLS:CALLS + 1] + 1, at, own.index_select(0, at), zero.index_select(0, at)])
    kept = tally.firsts[number]
    kept.copy_(torch.where(differ.any() & (kept[STEP] == 0), row, kept))


def _flat(values):
    """The values as one int64 row, one after another (no copy where one int64 value is given)."""
    import torch

    if len(values) == 1:
        return values[0].reshape(-1).to(torch.int64)
    return torch.cat([t.reshape(-1).to(torch.int64) for t in values])


def _stop_if_diverged() -> None:
    """Raise Diverged, after one line, where a landed read shows a diverged call."""
    global _stopped
    for tally in _tallies.values():
        diverged = tally.reported[:, DIVERGED_CALLS].nonzero().flatten().tolist()  # host memory
        if diverged:
            number = diverged[0]
            step, element, mine, theirs = tally.landed_firsts[number].tolist()
            calls, diverged_calls, elements = tally.reported[number].tolist()
            site, rank = f"{number}:{_slugs.get(number, '?')}", log.process_label()
            message = (f"tp_divergence abort: site={site} rank={rank} step={step} mine={mine} rank0={theirs} "
                       f"element={element} (the site's call {step} first differed from rank 0's; seen after {calls} "
                       f"calls, {diverged_calls} diverged, {elements} elements; {ABORT_FLAG})")
            log.emit(message, adapter="tp_divergence", site=site, step=step, mine=mine, rank0=theirs, element=element)
            _stopped = message
            raise Diverged(message)


def raise_if_stopped() -> None:
    """Called by the wrappers before a broadcast: once this rank has stopped, an engine
    `except Exception` around a site call (0.5.16 - 0.5.23 DFlash's Triton accept falls back
    to its eager path on any exception) must not lead it into one more collective than rank 0."""
    if _stopped is not None:
        raise Diverged(_stopped)


def dump() -> str:
    """The report's state for the engine's watchdog: the last landed read of each device's
    counters (host memory; the device, possibly wedged, is not asked), '' before any read."""
    parts = []
    for tally in _tallies.values():
        if not tally.landed_at and not tally.reported.any():
            continue
        totals = tally.reported.sum(0).tolist()
        where = f"rank={log.process_label()} device={tally.device} as of call {tally.landed_at}"
        if _last_diverged is None or not tally.reported[_last_diverged, DIVERGED_CALLS]:
            parts.append(f"tp_divergence: {where}: no diverged call ({totals[CALLS]} site calls)")
            continue
        number = _last_diverged
        calls, diverged_calls, elements = tally.reported[number].tolist()
        step = int(tally.landed_firsts[number, STEP])
        parts.append(f"tp_divergence: {where}: last diverged site={number}:{_slugs.get(number, '?')} by its call "
                     f"{calls} (diverged_calls={diverged_calls} diverged_elements={elements}"
                     + (f", first at call {step}" if step else "") + f"); all sites: calls={totals[CALLS]} "
                     f"diverged_calls={totals[DIVERGED_CALLS]} diverged_elements={totals[DIVERGED_ELEMENTS]}")
    return "\n".join(parts)


def _start_reads() -> None:
    global _reading
    for t in _tallies.values():
        if not t.in_flight:
            t.start_read()
    _reading = True


def _print_landed(wait: bool = False) -> list[str]:
    global _reading, _last_diverged
    lines = []
    for tally in _tallies.values():
        if tally.in_flight and (wait or tally.landed()):
            if wait and tally.event is not None:
                tally.event.synchronize()
            tally.in_flight = False
            delta = tally.host - tally.reported
            tally.reported.copy_(tally.host)
            tally.landed_firsts.copy_(tally.host_firsts)
            tally.landed_at = tally.read_at
            grew = delta[:, DIVERGED_CALLS].nonzero().flatten().tolist()
            if grew:
                _last_diverged = grew[-1]
            if wait or not _abort:  # with abort the rank's one line says it, until the exit report
                lines += _lines(delta)
            _export(delta)
    _reading = any(t.in_flight for t in _tallies.values())
    return lines


def _lines(delta) -> list[str]:
    """One line per site that diverged (printed), e.g. `... rank=1 tp_divergence site=8:dspark-accept-greedy
    calls=118 diverged_calls=3 diverged_elements=5 (since the last report)`."""
    lines = []
    for number, row in enumerate(delta.tolist()):  # host memory: no device sync
        if row[DIVERGED_CALLS]:
            counts = dict(zip(("calls", "diverged_calls", "diverged_elements"), row))
            site = f"{number}:{_slugs.get(number, '?')}"
            lines.append(log.emit(f"tp_divergence site={site} {' '.join(f'{k}={v}' for k, v in counts.items())} "
                                  "(since the last report)", adapter="tp_divergence", site=site, **counts))
    return lines


def flush() -> list[str]:
    """Read every device's counters now (waiting for them) and print what diverged since
    the last report; at exit, and for tests."""
    for tally in _tallies.values():
        if tally.in_flight:
            _print_landed(wait=True)
        tally.start_read()
    return _print_landed(wait=True)


def totals() -> dict[str, list[int]]:
    """Every site's counters since the last reset, waiting for the device ("n:slug" ->
    [calls, diverged calls, diverged elements], summed over devices); tests and benchmarks."""
    out: dict[str, list[int]] = {}
    for tally in _tallies.values():
        for number, row in enumerate(tally.counts.tolist()):
            if row[CALLS]:
                key = f"{number}:{_slugs.get(number, '?')}"
                out[key] = [a + b for a, b in zip(out.get(key, [0, 0, 0]), row)]
    return out


def forget() -> None:
    """Drop every device's counters and the comparison's decision (tests): the next call
    makes them anew."""
    global _reading, _kernel, _stopped
    _tallies.clear()
    _reading, _kernel, _stopped = False, None, None
    _said_torch.clear()


def reset() -> None:
    """Zero the counters in place (a captured graph keeps writing the same tensors)."""
    global _calls, _reading, _last_diverged, _stopped
    for tally in _tallies.values():
        if tally.in_flight and tally.event is not None:
            tally.event.synchronize()
        tally.in_flight = False
        tally.counts.zero_()
        tally.reported.zero_()
        tally.firsts.zero_()
        tally.landed_firsts.zero_()
        tally.landed_at = 0
    _calls, _reading = 0, False
    _last_diverged = _stopped = None


def _export(delta) -> None:
    """Add the counts to the Prometheus counters (adapter.framework.metrics) when the engine serves them."""
    for number, row in enumerate(delta.tolist()):
        if row[CALLS]:
            for (name, doc), value in zip(METRICS, row):
                metrics.count(f"tp_divergence_{name}", doc, value, site=f"{number}:{_slugs.get(number, '?')}")
