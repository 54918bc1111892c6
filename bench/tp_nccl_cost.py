"""Cost of the broadcast sites over a real TP group (NCCL, inside CUDA graphs), every variant in one run.

    python bench/tp_nccl_cost.py [--json OUT] [--world N] [--reps 5] [--calls 200] [--replays 20] [--cpu]

One process per rank (harness/nccl.py spawn_ranks; world = every visible GPU), the TP
group sglang 0.5.23's own GroupCoordinator (pynccl inside graphs, as its TP group), or the
torch.distributed NCCL fallback where that cannot be built (the kind is printed). Each case
is one unit, measured three ways (median of --reps, the cases interleaved in each rep):
  eager host   host time per unit to issue it (microseconds)
  eager wall   time per unit with the device drained at the end (what a rank waits)
  captured     GPU time per unit in a CUDA graph of --per-graph units (cuda events)
Cases, bs 1 / 8 / 64 (the kernel library's paths beside the bare collectives and the old
paths, in the same run):
  site/*       one site call: the bare group.broadcast; the engine's SpecTpSync.sync with
               the site on / off (off: no collective) and the divergence report on / off;
               the pack's broadcast() (0.5.16 - 0.5.18) with and without the report wrapper.
               report_on: the fused comparison of the kernel library (one launch, plus one
               for the copy of mine at a site broadcast in place); report_on_torch: torch ops
  step/*       one decode step, gamma 3 and 7: gamma draft broadcasts + the accept triple
               (int32 accept length, int64 bonus, int32 trim, as the engine's);
               bare = the collectives the pack issues (gamma + one buffer of the triple's
               bytes), bare_three = those the engine issues (gamma + 3); pack_on/report_off:
               the triple packed by the library (one launch into one block), _cat: by the
               concatenation (the old path)
  triple/*     the accept triple: one broadcast of a preallocated buffer of its bytes
               (one_buffer, the ref), the same buffer written by a kernel just before
               (one_buffer_written: the fields adjacent by construction, as a producing
               kernel would leave them), three broadcasts, the pack's broadcast() with the
               library's block (packed: one launch copies the fields into one new block,
               one broadcast, the results typed tensors over it) and with the concatenation
               (packed_cat: one concatenation of the fields' bytes, the results views),
               the same through the wrapper the pack puts on the captured accept
               (rank0_broadcast._graph_accept), with the report (no copy of mine: the
               fields stay as they were), the concatenation alone and the block alone
"+%" compares a case with the bare collectives it issues (its `ref`): the pack's goal reads
triple/*/packed and step/*/pack_on/report_off there (at most +20 %). "rep +us/site": the eager
host time a report case adds to the same case with the report off, per site call (the
report's goal: at most 10 us). --cpu (or no CUDA): gloo CPU processes, eager only (a check
that the code runs; the figures are gloo's, and the library serves CUDA tensors only, so both
paths of each pair are the old ones there).
NVLink multicast is off in every process (harness/nccl.py NO_MULTICAST).
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import pathlib
import platform
import statistics
import sys
import time
from dataclasses import dataclass
from typing import Callable, Optional

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from harness.nccl import NO_MULTICAST, capture, device_of, make_group, report, spawn_ranks  # noqa: E402

SIZES, GAMMAS = (1, 8, 64), (3, 7)


@dataclass
class Case:
    name: str
    op: Callable[[], None]
    collectives: int  # collectives one unit issues
    report: bool = False  # the engine's report switched on (class-wide patch of SpecTpSync.sync)
    ref: Optional[str] = None  # the bare case issuing the same collectives
    kernel: bool = True  # the library's one-launch pack and comparison; False: concatenation, torch ops
    base: Optional[str] = None  # a report case: the same case with the report off
    sites: int = 1  # site calls one unit makes


def paths(kernel: bool) -> None:
    from sglang_dsv41_adapters.spectpsync import broadcast as b
    from sglang_dsv41_adapters.tp_divergence import divergence

    b.use_kernel(kernel)
    divergence.use_kernel(kernel)


def build_cases(group, device):
    from sglang.srt.speculative.spec_tp_sync import SpecTpSync, SpecTpSyncSite as S

    import wrapt

    from sglang_dsv41_adapters.folded_fence import accept_snapshot
    from sglang_dsv41_adapters.spectpsync import broadcast as b
    from sglang_dsv41_adapters.rank0_broadcast.before_0_5_19 import _graph_accept
    from sglang_dsv41_adapters import tp_divergence as t
    from sglang_dsv41_adapters.spectpsync.sites import Site

    os.environ.pop("SGLANG_SPEC_TP_SYNC", None)
    sync_on = SpecTpSync(group)  # every site broadcast (the engine's default)
    os.environ["SGLANG_SPEC_TP_SYNC"] = "off"
    sync_off = SpecTpSync(group)
    del os.environ["SGLANG_SPEC_TP_SYNC"]
    b.bind_group(b.DSPARK, group)
    pack, pack_report = b.broadcast, wrapt.FunctionWrapper(b.broadcast, t.before_0_5_19.compare_broadcast(1000))
    bare = functools.partial(group.broadcast, src=0)

    def late(sync):
        # Looked up at each call: the report patches SpecTpSync.sync class-wide after the
        # cases are built, and a bound method taken now would keep calling the original.
        return lambda *args: sync.sync(*args)

    def repeat(*calls):
        def op():
            for fn, args in calls:
                fn(*args)
        return op

    cases = []
    for bs in SIZES:
        v = torch.arange(bs, device=device)
        p = f"site/bs{bs}"
        engine_on = repeat((late(sync_on), (S.DSPARK_DRAFT, v)))
        pack_on, pack_on_report = repeat((pack, (b.DSPARK, Site.DSPARK_DRAFT, v))), repeat((pack_report, (b.DSPARK, Site.DSPARK_DRAFT, v)))
        cases += [Case(f"{p}/bare", repeat((bare, (v,))), 1),
                  Case(f"{p}/engine_on/report_off", engine_on, 1, False, f"{p}/bare"),
                  Case(f"{p}/engine_on/report_on", engine_on, 1, True, f"{p}/bare", base=f"{p}/engine_on/report_off"),
                  Case(f"{p}/engine_on/report_on_torch", engine_on, 1, True, f"{p}/bare", kernel=False,
                       base=f"{p}/engine_on/report_off"),
                  Case(f"{p}/engine_off/report_off", repeat((late(sync_off), (S.DSPARK_DRAFT, v))), 0, False),
                  Case(f"{p}/engine_off/report_on", repeat((late(sync_off), (S.DSPARK_DRAFT, v))), 0, True),
                  Case(f"{p}/pack_on/report_off", pack_on, 1, False, f"{p}/bare"),
                  Case(f"{p}/pack_on/report_on", pack_on_report, 1, False, f"{p}/bare", base=f"{p}/pack_on/report_off"),
                  Case(f"{p}/pack_on/report_on_torch", pack_on_report, 1, False, f"{p}/bare", kernel=False,
                       base=f"{p}/pack_on/report_off")]
    for gamma in GAMMAS:
        for bs in SIZES:
            draft = torch.arange(bs, device=device)
            fields, buf = accept_triple(bs, device)
            p = f"step/g{gamma}/bs{bs}"
            drafts = lambda fn, *head: [(fn, (*head, draft))] * gamma  # noqa: E731
            cases += [Case(f"{p}/bare", repeat(*drafts(bare), (bare, (buf,))), gamma + 1),
                      Case(f"{p}/bare_three", repeat(*drafts(bare), *[(bare, (f,)) for f in fields]), gamma + 3)]
            for state, sync, n in (("on", sync_on, gamma + 3), ("off", sync_off, 0)):
                op = repeat(*drafts(late(sync), S.DSPARK_DRAFT), *[(late(sync), (S.DSPARK_ACCEPT_GRAPH, f)) for f in fields])
                off = f"{p}/engine_{state}/report_off"
                cases += [Case(off, op, n, False, f"{p}/bare_three" if n else None, sites=gamma + 3),
                          Case(f"{p}/engine_{state}/report_on", op, n, True, f"{p}/bare_three" if n else None, base=off,
                               sites=gamma + 3)]
                if n:
                    cases.append(Case(f"{p}/engine_{state}/report_on_torch", op, n, True, f"{p}/bare_three",
                                      kernel=False, base=off, sites=gamma + 3))
            off = f"{p}/pack_on/report_off"
            for name, fn, kernel in (("report_off", pack, True), ("report_off_cat", pack, False),
                                     ("report_on", pack_report, True), ("report_on_torch", pack_report, False)):
                op = repeat(*drafts(fn, b.DSPARK, Site.DSPARK_DRAFT), (fn, (b.DSPARK, Site.DSPARK_ACCEPT_GRAPH, *fields)))
                cases.append(Case(f"{p}/pack_on/{name}", op, gamma + 1, False, f"{p}/bare", kernel=kernel,
                                  base=off if fn is pack_report else None, sites=gamma + 1))
    for bs in SIZES:
        fields, buf = accept_triple(bs, device)
        hooked = wrapt.FunctionWrapper(lambda fields=fields, **kwargs: fields, _graph_accept)
        p = f"triple/bs{bs}"
        packed = repeat((pack, (b.DSPARK, Site.DSPARK_ACCEPT_GRAPH, *fields)))
        reported = repeat((pack_report, (b.DSPARK, Site.DSPARK_ACCEPT_GRAPH, *fields)))
        cases += [Case(f"{p}/one_buffer", repeat((bare, (buf,))), 1),
                  Case(f"{p}/packed", packed, 1, False, f"{p}/one_buffer"),
                  Case(f"{p}/packed_cat", packed, 1, False, f"{p}/one_buffer", kernel=False),
                  Case(f"{p}/packed_hook", repeat((hooked, ())), 1, False, f"{p}/one_buffer"),
                  Case(f"{p}/packed_report", reported, 1, False, f"{p}/one_buffer", base=f"{p}/packed"),
                  Case(f"{p}/packed_report_torch", reported, 1, False, f"{p}/one_buffer", kernel=False,
                       base=f"{p}/packed_cat"),
                  Case(f"{p}/three_broadcasts", repeat(*[(bare, (f,)) for f in fields]), 3, False, f"{p}/one_buffer"),
                  # the eager ref where the fields are adjacent by construction: the kernel that
                  # produced them has just written the buffer (a standing buffer broadcasts faster)
                  Case(f"{p}/one_buffer_written", repeat((lambda buf=buf: bare(buf.add_(0)), ())), 1),
                  Case(f"{p}/cat_only", repeat((lambda fields=fields: torch.cat([f.view(torch.int32) for f in fields]), ())), 0)]
        library = accept_snapshot.extension() if device.type == "cuda" else None
        if library is not None:
            cases.append(Case(f"{p}/block_only", repeat((library.pack, (fields,))), 0))
    return cases


def accept_triple(bs, device):
    """The accept triple as the engine returns it (int32 correct_len, int64 bonus, int32
    cap_trim_lens) and a buffer of its size and of the dtype the pack packs it in (int32):
    what one broadcast of it moves."""
    fields = [torch.arange(bs, dtype=dtype, device=device) + i
              for i, dtype in enumerate((torch.int32, torch.int64, torch.int32))]
    return fields, torch.zeros(4 * bs, dtype=torch.int32, device=device)


def cost_rank(rank, world, nccl, reps, calls, replays, per_graph):
    import torch.distributed as dist

    from sglang_dsv41_adapters.tp_divergence import divergence
    from sglang_dsv41_adapters import tp_divergence as t

    group, kind = make_group(rank, world, nccl)
    device = device_of(group, nccl)
    cases = build_cases(group, device)

    def sync():
        if nccl:
            torch.cuda.synchronize()

    graphs = {}
    if nccl:  # captured with the report as each case needs it; a unit without a collective is not captured
        for on in (False, True):
            report(on, t.DEFAULT_EVERY)
            for case in cases:
                if case.report == on and case.collectives:
                    paths(case.kernel)
                    graphs[case.name] = capture(group, lambda c=case: [c.op() for _ in range(per_graph)], nccl)

    for on in (False, True):  # one eager pass first: lazy communicator set-up stays out of the figures
        report(on, t.DEFAULT_EVERY)
        for case in cases:
            paths(case.kernel)
            case.op()
        sync()
        dist.barrier()
    times = {c.name: {"eager_host": [], "eager_wall": [], "captured": []} for c in cases}
    for _ in range(reps):
        for on in (False, True):
            report(on, t.DEFAULT_EVERY)
            for case in (c for c in cases if c.report == on):
                paths(case.kernel)
                sync()
                dist.barrier()
                start = time.perf_counter()
                for _ in range(calls):
                    case.op()
                issued = time.perf_counter()
                sync()
                drained = time.perf_counter()
                times[case.name]["eager_host"].append((issued - start) / calls * 1e6)
                times[case.name]["eager_wall"].append((drained - start) / calls * 1e6)
                graph = graphs.get(case.name)
                if graph is None:
                    continue
                dist.barrier()
                begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                begin.record()
                for _ in range(replays):
                    graph.replay()
                end.record()
                end.synchronize()
                times[case.name]["captured"].append(begin.elapsed_time(end) * 1e3 / (replays * per_graph))
    report(False)
    paths(True)
    diverged = {k: v for k, v in divergence.totals().items() if v[1]}  # no skew: must stay empty
    results = {c.name: {"collectives": c.collectives, "ref": c.ref, "report": c.report, "kernel": c.kernel,
                        "base": c.base, "sites": c.sites,
                        **{k: statistics.median(v) if v else None for k, v in times[c.name].items()}} for c in cases}
    from sglang_dsv41_adapters.spectpsync import broadcast as b

    # what served the CUDA tensors (the library serves no CPU tensor: there the old paths serve)
    modes = {"packing": b.packing_mode(), "compare": divergence.compare_mode()} if nccl else \
        {"packing": ("concatenation", "CPU tensors"), "compare": ("torch ops", "CPU tensors")}
    return {"group": kind, "results": results, "diverged": diverged, "paths": modes}


def _pct(value, ref):
    return "" if value is None or not ref else f"{(value / ref - 1) * 100:+.0f}%"


def table(ranks) -> str:
    rows = ranks[0]["results"]
    head = (f"{'case (rank 0)':<44}{'coll':>5}{'eager host':>12}{'':>6}{'rep +us/site':>13}{'eager wall':>12}{'':>6}"
            f"{'captured':>12}{'':>6}{'capt/coll':>10}")
    modes = ranks[0]["paths"]
    lines = [f"TP group: {ranks[0]['group']}; {len(ranks)} ranks; us per unit (median); +% over the bare collectives "
             f"the case issues (ref); rep +us/site: eager host time the report adds per site call",
             f"packing: {' - '.join(modes['packing'])}; report's comparison: {' - '.join(modes['compare'])} "
             "(*_cat, *_torch: the old paths, the library switched off)", head]
    for name, row in rows.items():
        ref = rows.get(row["ref"]) if row["ref"] else None
        cells = []
        for key in ("eager_host", "eager_wall", "captured"):
            value = row[key]
            cells.append(f"{value:>12.2f}" if value is not None else f"{'-':>12}")
            cells.append(f"{_pct(value, ref[key] if ref else None):>6}")
        per_coll = (f"{row['captured'] / row['collectives']:>10.2f}" if row["captured"] is not None and row["collectives"]
                    else f"{'-':>10}")
        base = rows.get(row["base"]) if row["base"] else None
        added = f"{(row['eager_host'] - base['eager_host']) / row['sites']:>+13.2f}" if base else f"{'':>13}"
        cells.insert(2, added)
        lines.append(f"{name:<44}{row['collectives']:>5}" + "".join(cells) + per_coll)
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", help="write the figures here")
    parser.add_argument("--world", type=int, help="ranks (default: every visible GPU; 2 with --cpu)")
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--calls", type=int, default=200, help="eager units per repetition")
    parser.add_argument("--replays", type=int, default=20, help="graph replays per repetition")
    parser.add_argument("--per-graph", type=int, default=10, help="units in one captured graph")
    parser.add_argument("--timeout", type=float, default=240, help="seconds before the ranks are killed")
    parser.add_argument("--cpu", action="store_true", help="gloo CPU processes, eager only")
    opts = parser.parse_args(argv)
    os.environ.update(NO_MULTICAST)
    nccl = not opts.cpu and torch.cuda.is_available() and torch.cuda.device_count() >= 2
    world = opts.world or (torch.cuda.device_count() if nccl else 2)
    ranks = spawn_ranks(world, "bench.tp_nccl_cost:cost_rank", nccl=nccl, timeout=opts.timeout,
                        kwargs={"reps": opts.reps, "calls": opts.calls, "replays": opts.replays,
                                "per_graph": opts.per_graph})
    print(table(ranks))
    found = {"mode": f"{'nccl' if nccl else 'gloo-cpu'}-{world}", "group": ranks[0]["group"], "ranks": ranks,
             "device": torch.cuda.get_device_name() if nccl else platform.processor(),
             "python": platform.python_version(), "torch": torch.__version__, "argv": sys.argv[1:],
             "env": {k: os.environ.get(k) for k in NO_MULTICAST}}
    if opts.json:
        pathlib.Path(opts.json).write_text(json.dumps(found, indent=2))
    diverged = [r["diverged"] for r in ranks]
    assert not any(diverged), f"divergence counted without a skew: {diverged}"
    return 0


if __name__ == "__main__":
    sys.exit(main())
