"""Where the divergence report's eager host time goes, piece by piece, on a GPU (the
report's goal: at most 10 us per eager site call):

    python bench/report_breakdown.py [--calls 20000] [--reps 7]

Host time per call (microseconds, median of --reps repetitions of --calls calls) at bs 64 on
one GPU, the kernel library loaded, the engine's SpecTpSync over bench/divergence_cost.py's
stand-in group (rank 1; its broadcast is one copy launch):

  empty_launch      one empty kernel launch through the kernel library (the yardstick)
  new_empty         values.new_empty(values.shape): a fresh tensor to receive rank 0's value into
  receive           the library's receive(values): the kept block the report receives into
  count_divergence  the library's fused compare-and-settle call alone, pairs as lists (one launch)
  count_pair        the same for one pair (what a site of one tensor calls)
  observe           divergence.observe(..., settle=True): the fused call and the report's Python
  sync_off          SpecTpSync.sync, the report off (the stand-in broadcast: one launch)
  floor             the unpatched SpecTpSync.sync into the kept block, then count_pair: the
                    report's two launches with none of its Python (what no wrapper can go under)
  sync_on           SpecTpSync.sync, the report on (tp_divergence's wrapper, as a rank applies it: its
                    C form, the kernel library's report_sync)
  sync_on_python    the same with the wrapper's Python form alone (divergence.use_c_form(False))

sync_on - sync_off is what the report adds per eager site call (bench/divergence_cost.py's figure);
floor - sync_off is the part of it that is the fused launch. The frames of the pack's one
sync_on call makes are printed first (the C form: only its dispatcher and report_sync).
"""

from __future__ import annotations

import argparse
import pathlib
import statistics
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

import torch  # noqa: E402

from divergence_cost import StandInGroup, switch  # noqa: E402
from fence_cost import host_us as per_call  # noqa: E402
from sglang_dsv41_adapters.folded_fence import accept_snapshot  # noqa: E402
from sglang_dsv41_adapters.tp_divergence import divergence  # noqa: E402


def pack_frames(call) -> list:
    """The pack's Python frames and the C functions they call during call()."""
    seen = []

    def note(frame, event, arg):
        if frame.f_globals.get("__name__", "").startswith("sglang_dsv41_adapters"):
            seen.append(frame.f_code.co_name + (f"->{arg.__name__}" if event == "c_call" else ""))

    sys.setprofile(note)
    try:
        call()
    finally:
        sys.setprofile(None)
    return seen


def main(argv=None) -> int:
    from sglang.srt.speculative.spec_tp_sync import SpecTpSync, SpecTpSyncSite as S

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--calls", type=int, default=20000)
    parser.add_argument("--reps", type=int, default=7)
    opts = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("report_breakdown: needs a CUDA GPU", file=sys.stderr)
        return 2
    kernel = accept_snapshot.probed_extension()
    if kernel is None:
        print(f"report_breakdown: no kernel library ({accept_snapshot.copy_mode()[1]})", file=sys.stderr)
        return 2
    values = torch.arange(64, device="cuda")
    stand_in = StandInGroup()
    stand_in.rank0 = values.clone()
    tp_sync = SpecTpSync(stand_in)
    received = values.clone()
    switch("on")
    number, slug = divergence.label(S.DSPARK_TARGET)
    tp_sync.sync(S.DSPARK_TARGET, values)  # the counters, the decisions (said once) before the clock
    tp_sync.sync(S.DSPARK_TARGET, values)  # binds the C form
    counts = next(iter(divergence._tallies.values())).counts
    unpatched = SpecTpSync.sync.__wrapped__  # the engine's own sync, under tp_divergence's wrapper
    block = kernel.receive(values)
    print("the pack's frames in one eager sync call:", ", ".join(pack_frames(lambda: tp_sync.sync(S.DSPARK_TARGET, values))))
    pieces = {
        "empty_launch": kernel.empty_launch,
        "new_empty": lambda: values.new_empty(values.shape),
        "receive": lambda: kernel.receive(values),
        "count_divergence": lambda: kernel.count_divergence((values,), (received,), counts, number, True),
        "count_pair": lambda: kernel.count_pair(values, received, counts, number, True),
        "observe": lambda: divergence.observe(number, slug, (values,), (received,), 1 << 40, settle=True),
        "floor": lambda: (unpatched(tp_sync, S.DSPARK_TARGET, block),
                          kernel.count_pair(values, block, counts, number, True)),
        "sync_on": lambda: tp_sync.sync(S.DSPARK_TARGET, values),
    }
    times = {name: [] for name in (*pieces, "sync_on_python", "sync_off")}
    for _ in range(opts.reps):
        switch("on")
        for name, fn in pieces.items():
            times[name].append(per_call(fn, opts.calls))
        divergence.use_c_form(False)
        times["sync_on_python"].append(per_call(pieces["sync_on"], opts.calls))
        divergence.use_c_form(True)
        switch("off")
        times["sync_off"].append(per_call(lambda: tp_sync.sync(S.DSPARK_TARGET, values), opts.calls))
    print(f"the report's eager host time, piece by piece, bs 64, us per call (median of {opts.reps} x {opts.calls}; "
          f"{torch.cuda.get_device_name()})")
    for name, runs in times.items():
        print(f"{name:<18}{statistics.median(runs):>8.2f}")
    for name in ("sync_on", "sync_on_python", "floor"):
        print(f"{name + ' - off':<22}{statistics.median(times[name]) - statistics.median(times['sync_off']):>8.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
