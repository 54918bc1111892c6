"""The parts of the fenced decode step at bs 8 in fence_cost's setting on a GPU (the served-looking
epilogue, a new result at each step as the engine's worker returns one), and of the served graph
step (its logits a slice of the graph's output): where the time over the step floor goes. Metrics
off, then on. Each part in us per call: the median and quartiles of 15 loops of 500 calls, the GPU
synchronized around each loop, the parts taking turns.

    python3 bench/diag_step.py KERNEL_FILE
"""

from __future__ import annotations

import os
import pathlib
import statistics
import sys
import tempfile

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from sglang_dsv41_adapters.folded_fence import accept_snapshot, fence_boundary  # noqa: E402
from sglang_dsv41_adapters.framework import metrics  # noqa: E402
from bench import fence_cost as fc  # noqa: E402
from bench.fence_host_cost import STRIDE, captured, decode_result, rebuilt, worker_of  # noqa: E402

BS = 8


def parts_table(parts: dict, reps: int = 15, calls: int = 500) -> None:
    samples = {name: [] for name in parts}
    for call in parts.values():
        fc.host_us(call, 300)
    for _ in range(reps):
        for name, call in parts.items():
            samples[name].append(fc.host_us(call, calls))
    for name, times in samples.items():
        times.sort()
        print(f"{name:<30} {statistics.median(times):7.2f}  ({times[reps // 4]:.2f}..{times[reps * 3 // 4]:.2f})")


def table(lib) -> None:
    verify, epilogue, executor, device = fc.build(256)
    full = fc.build(256)[1]
    captured(full)
    fence_boundary.reset()
    fence_boundary.use_native(lib)
    result = decode_result(BS, device=device)
    logits = full.static_io[BS].logits[: BS * STRIDE]
    new = lambda self, batch: rebuilt(result)  # noqa: E731
    graph = lambda self, batch: rebuilt(result, logits=logits)  # noqa: E731
    same = lambda self, batch: result  # noqa: E731
    served, bare = worker_of(full, new), worker_of(full, new, checked=False)
    served_same = worker_of(full, same)
    served_graph, bare_graph = worker_of(full, graph), worker_of(full, graph, checked=False)
    for w in (served, served_same, served_graph):
        w.forward_batch_generation(None)
        w.forward_batch_generation(None)
    scan = fence_boundary._storages[id(full)][4]
    wide = torch.zeros(BS * STRIDE, 129280, device=device)  # a served vocabulary's logits at bs 8
    parts = {
        "bare new result": lambda: bare.forward_batch_generation(None),
        "bare new + scan": lambda: scan(bare.forward_batch_generation(None), full),
        "served new (C check)": lambda: served.forward_batch_generation(None),
        "scan(None) (map test)": lambda: scan(None, full),
        "scan(same result)": lambda: scan(result, full),
        "served same result": lambda: served_same.forward_batch_generation(None),
        "bare graph result": lambda: bare_graph.forward_batch_generation(None),
        "served graph (C copy)": lambda: served_graph.forward_batch_generation(None),
        "clone (bench logits)": lambda: logits.clone(),
        "dense_copy (bench logits)": lambda: lib.dense_copy(logits),
        "clone (129280 wide)": lambda: wide.clone(),
        "dense_copy (129280 wide)": lambda: lib.dense_copy(wide),
        "_said_copy": lambda: fence_boundary._said_copy("diag route"),
        "empty launch": lib.empty_launch,
    }
    print("check mode:", fence_boundary.check_mode(), "metrics on:", metrics.enabled(), flush=True)
    parts_table(parts)


def main() -> None:
    lib = accept_snapshot.load(sys.argv[1])[0]
    print("== metrics off", flush=True)
    table(lib)
    os.environ[metrics.FOLDER] = tempfile.mkdtemp()
    metrics.reset()
    print("== metrics on", flush=True)
    table(lib)


if __name__ == "__main__":
    main()
