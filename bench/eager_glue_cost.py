"""Host time of the Python around the kernel library's calls on the eager decode path (what the
library's launches leave of the pack's cost per site call), on a machine without a GPU:

    .venv/bin/python bench/eager_glue_cost.py [--calls 20000] [--reps 5]

The pack's broadcast of the accept triple (int32, int64, int32; bs 64) and of one draft tensor,
each with and without the divergence report's wrapper (0.5.16 - 0.5.18's), through the paths
CUDA tensors take: the tensors are CPU tensors labelled CUDA (tests/test_eager_paths.py's
`on_cuda`), the library's pack / snapshot / count_divergence and the collective are no-ops
returning ready results. So each figure is what the pack's own Python costs per site call,
without the launches (a GPU run adds about one launch per library call: bench/tp_nccl_cost.py
and bench/divergence_cost.py measure those). The labelled tensors' attribute reads go through a
Python subclass, which makes these figures an upper bound. Median of --reps, microseconds.
"""

from __future__ import annotations

import argparse
import pathlib
import statistics
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import wrapt  # noqa: E402

from tests.test_eager_paths import on_cuda  # noqa: E402
from sglang_dsv41_adapters.folded_fence import accept_snapshot  # noqa: E402
from sglang_dsv41_adapters.spectpsync import broadcast as b  # noqa: E402
from sglang_dsv41_adapters.spectpsync.sites import Site  # noqa: E402
from sglang_dsv41_adapters.tp_divergence import before_0_5_19, divergence  # noqa: E402


class ReadyLibrary:
    """The library's calls, answered at once with results made beforehand."""

    def __init__(self, parts):
        self.parts = parts

    def pack(self, tensors):
        return self.parts

    def snapshot(self, tensors):
        return list(tensors)

    def count_divergence(self, mine, theirs, counts, row, settle):
        return True


class NoCollective:
    world_size, rank_in_group = 2, 1

    def broadcast(self, tensor, src=0):
        return tensor


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--calls", type=int, default=20000)
    parser.add_argument("--reps", type=int, default=5)
    opts = parser.parse_args(argv)
    torch.cuda.is_current_stream_capturing = lambda: False  # no GPU: nothing is being captured
    fields = [on_cuda(torch.arange(64, dtype=dtype)) for dtype in (torch.int32, torch.int64, torch.int32)]
    library = ReadyLibrary([on_cuda(torch.zeros(64 * 4 + 8, dtype=torch.int32))] + [on_cuda(f.clone()) for f in fields])
    accept_snapshot.extension = lambda: library
    b.bind_group(b.DSPARK, NoCollective())
    reported = wrapt.FunctionWrapper(b.broadcast, before_0_5_19.compare_broadcast(1000))
    draft = on_cuda(torch.arange(64))
    cases = {"triple": lambda: b.broadcast(b.DSPARK, Site.DSPARK_ACCEPT_GRAPH, *fields),
             "triple, report on": lambda: reported(b.DSPARK, Site.DSPARK_ACCEPT_GRAPH, *fields),
             "draft": lambda: b.broadcast(b.DSPARK, Site.DSPARK_DRAFT, draft),
             "draft, report on": lambda: reported(b.DSPARK, Site.DSPARK_DRAFT, draft)}
    # 0.5.19+: the engine's SpecTpSync.sync on a receiving rank, with the report's wrapper
    from sglang.srt.speculative.spec_tp_sync import SpecTpSync, SpecTpSyncSite as S
    from sglang_dsv41_adapters import tp_divergence as t

    tp_sync = SpecTpSync(NoCollective())
    synced = wrapt.FunctionWrapper(SpecTpSync.sync, t.compare_sync(1000))
    cases.update({"sync": lambda: tp_sync.sync(S.DSPARK_TARGET, draft),
                  "sync, report on": lambda: synced.__get__(tp_sync, SpecTpSync)(S.DSPARK_TARGET, draft)})
    times = {name: [] for name in cases}
    for fn in cases.values():
        fn()  # the decisions (one line each) before the clock
    for _ in range(opts.reps):
        for name, fn in cases.items():
            start = time.perf_counter()
            for _ in range(opts.calls):
                fn()
            times[name].append((time.perf_counter() - start) / opts.calls * 1e6)
    print("the pack's Python per site call, library calls and collective stood in (us, median)")
    for name, values in times.items():
        print(f"{name:<20}{statistics.median(values):>8.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
