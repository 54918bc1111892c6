"""The boundary check's per-step test that the epilogue's memory is as it was mapped
(`scan(None, epilogue)`, the native scan of nothing), against epilogues of growing size:
the bench's plain one, one whose static_io holds every captured batch size up to 256, one
with only the commit context's draft model, and both (as a served epilogue looks).

    python bench/boundary_freshness.py KERNEL_FILE [--before OTHER_KERNEL_FILE] [--calls N]

Also the scan of a clean decode result (that test and the walk), the worker's call through
check_results (that and wrapt's), and what the check adds to a worker that returns a new result
at each step as the engine's does (the same call unchecked beside it): reading a new holder's
__dict__ makes that dict, which a result returned again has already. Against an epilogue as
served, also what it adds where the result's logits are the graph's, as 0.5.23's decode graph
returns them (a slice of the output static_io[bs].logits holds): copied at each step.

Microseconds per call, the median of 5 x --calls (20000); the kernel file is a built
dsv41_accept_snapshot.so (its native scan runs on the CPU too). With --before, a kernel
file built from other sources of the pack (an earlier commit; loaded unchecked) is measured in the same run:
each file in processes of its own (both carry one module name), three of each, alternating.
"""

import argparse
import json
import os
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from sglang_dsv41_adapters.folded_fence import accept_snapshot, fence_boundary  # noqa: E402
from bench.fence_host_cost import STRIDE, captured, decode_result, dspark, rebuilt, worker_of  # noqa: E402


CALLS = 20000


def us(call, n: int = 0) -> float:
    n = n or CALLS
    for _ in range(200):
        call()
    samples = []
    for _ in range(5):
        start = time.perf_counter()
        for _ in range(n):
            call()
        samples.append((time.perf_counter() - start) / n * 1e6)
    return sorted(samples)[2]


def scan_of(library, epilogue):
    """The scan `library` binds for `epilogue`'s map, the map made by the walk as a step would."""
    fence_boundary.reset()
    fence_boundary.use_native(library)
    fence_boundary._checked(decode_result(8), epilogue)  # maps the epilogue, binds the scan
    cached = fence_boundary._storages[id(epilogue)]
    return cached[4], cached


LABELS = ("plain", "static_io only", "commit_ctx only", "both")


def paired(first, second) -> tuple:
    """(us per call of first, of second), each the median of three measurements taken alternately."""
    runs = [(us(first), us(second)) for _ in range(3)]
    return sorted(r[0] for r in runs)[1], sorted(r[1] for r in runs)[1]


def measure(library) -> dict:
    """label -> (us per scan(None), per scan(result), per worker call through check_results,
    values mapped, tensors mapped); result: the bench's decode result at bs 8."""
    found = {}
    for label in LABELS:
        epilogue = dspark(256)[1]
        if label != "plain":
            captured(epilogue)
            if label == "static_io only":
                epilogue.commit_ctx = None
            if label == "commit_ctx only":
                epilogue.static_io.clear()
        scan, cached = scan_of(library, epilogue)
        result = decode_result(8)
        worker = worker_of(epilogue, lambda self, batch: result)
        assert worker.forward_batch_generation(None) is result and scan(result, epilogue)  # clean: nothing copied
        # a new result at each step, as the engine's worker returns: checked, and the same step unchecked
        step = lambda self, batch: rebuilt(result)  # noqa: E731
        fresh, bare = worker_of(epilogue, step), worker_of(epilogue, step, checked=False)
        checked_us, bare_us = paired(lambda: fresh.forward_batch_generation(None), lambda: bare.forward_batch_generation(None))
        graph_us = float("nan")
        if label == "both":  # the logits as the graph returns them: the check copies them at each step
            logits = epilogue.static_io[8].logits[: 8 * STRIDE]
            graph = lambda self, batch: rebuilt(result, logits=logits)  # noqa: E731
            copied, bare_graph = worker_of(epilogue, graph), worker_of(epilogue, graph, checked=False)
            assert copied.forward_batch_generation(None).logits_output.next_token_logits is not logits
            graph_checked, graph_bare = paired(lambda: copied.forward_batch_generation(None),
                                               lambda: bare_graph.forward_batch_generation(None))
            graph_us = graph_checked - graph_bare
        found[label] = (us(lambda: scan(None, epilogue)), us(lambda: scan(result, epilogue)),
                        us(lambda: worker.forward_batch_generation(None)), checked_us - bare_us, graph_us,
                        sum(len(node[1]) for node in cached[1]), len(cached[2][0]))
    return found


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("kernel")
    parser.add_argument("--before", help="a kernel file built from an earlier commit's sources")
    parser.add_argument("--calls", type=int, default=CALLS, help="calls per measurement (default %(default)s)")
    parser.add_argument("--one", choices=("this", "before"), help=argparse.SUPPRESS)  # a child's run
    args = parser.parse_args()
    globals()["CALLS"] = args.calls
    if args.one:
        library = accept_snapshot.load(args.kernel)[0] if args.one == "this" else accept_snapshot.imported(args.kernel)
        print(json.dumps(measure(library)))
        return 0
    runs = {"this": args.kernel, **({"before": args.before} if args.before else {})}
    figures = {name: [] for name in runs}
    for _ in range(3):  # each kernel file in a process of its own (one module name), interleaved
        for name, path in runs.items():
            child = subprocess.run([sys.executable, __file__, path, "--one", name, "--calls", str(args.calls)],
                                   capture_output=True, text=True)
            if child.returncode != 0:
                print(child.stderr[-3000:], file=sys.stderr)
                return 1
            figures[name].append(json.loads(child.stdout.strip().splitlines()[-1]))
            print(f"{name}: {figures[name][-1]}", flush=True)  # as it comes, for a run cut short
    print("us per call, the median of 3 processes each: scan(None) (the map still holds), scan(result) (that and the"
          " walk of a clean decode result), the worker's call through check_results (that and wrapt's), and what the"
          " check adds to a worker that returns a new result at each step (built alike, its holders' __dict__s unread),"
          " and the same with the graph's logits in it (as served: copied at each step)")
    for label in LABELS:
        values, tensors = figures["this"][0][label][5:]
        print(f"{label} ({values} values, {tensors} tensors mapped):")
        for at, what in enumerate(("scan(None)", "scan(result)", "worker call", "check, new result",
                                   "check, graph logits")[: 5 if label == "both" else 4]):
            said = "; ".join(f"{name} {sorted(run[label][at] for run in runs_of)[1]:.2f}" for name, runs_of in figures.items())
            print(f"  {what:<18} {said}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
