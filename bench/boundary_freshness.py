"""The boundary check's per-step test that the epilogue's memory is as it was mapped
(`scan(None, epilogue)`, the native scan of nothing), against epilogues of growing size:
the bench's plain one, one whose static_io holds every captured batch size up to 256, one
with only the commit context's draft model, and both (as a served epilogue looks).

    python bench/boundary_freshness.py KERNEL_FILE

Microseconds per call, the median of 5 x 20000; the kernel file is a built
dsv41_accept_snapshot.so (its native scan runs on the CPU too).
"""

import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from sglang_dsv41_adapters.folded_fence import accept_snapshot, fence_boundary  # noqa: E402
from bench.fence_host_cost import captured, decode_result, dspark  # noqa: E402


def us(call, n: int = 20000) -> float:
    for _ in range(200):
        call()
    samples = []
    for _ in range(5):
        start = time.perf_counter()
        for _ in range(n):
            call()
        samples.append((time.perf_counter() - start) / n * 1e6)
    return sorted(samples)[2]


def main() -> int:
    library = accept_snapshot.load(sys.argv[1])[0]
    fence_boundary.reset()
    fence_boundary.use_native(library)
    for label in ("plain", "static_io only", "commit_ctx only", "both"):
        epilogue = dspark(256)[1]
        if label != "plain":
            captured(epilogue)
            if label == "static_io only":
                epilogue.commit_ctx = None
            if label == "commit_ctx only":
                epilogue.static_io.clear()
        fence_boundary._checked(decode_result(8), epilogue)  # maps the epilogue, binds the scan
        cached = fence_boundary._storages[id(epilogue)]
        scan = cached[4]
        print(f"{label}: scan(None) {us(lambda: scan(None, epilogue)):.2f} us; "
              f"values {sum(len(node[1]) for node in cached[1])} tensors {len(cached[2][0])}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
