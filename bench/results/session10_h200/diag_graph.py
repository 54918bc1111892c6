"""Diagnostic: the parts of the boundary check on the served graph result (its logits a slice of
the graph's output, which static_io[bs].logits holds), in fence_cost's setting on the GPU, bs 8."""
import os, sys
sys.path.insert(0, os.getcwd())
import torch
from sglang_dsv41_adapters.folded_fence import accept_snapshot, fence_boundary
from sglang_dsv41_adapters.framework import metrics
from bench import fence_cost as fc
from bench.fence_host_cost import STRIDE, captured, decode_result, parts_table, rebuilt, worker_of

lib = accept_snapshot.load(sys.argv[1])[0]
verify, epilogue, executor, device = fc.build(256)
full = fc.build(256)[1]
captured(full)
fence_boundary.use_native(lib)
bs = 8
result = decode_result(bs, device=device)
logits = full.static_io[bs].logits[: bs * STRIDE]
graph = lambda self, batch: rebuilt(result, logits=logits)
served, bare = worker_of(full, graph), worker_of(full, graph, checked=False)
served.forward_batch_generation(None)
scan = fence_boundary._storages[id(full)][4]
fresh = lambda: bare.forward_batch_generation(None)
found = scan(fresh(), full)
route = fence_boundary.shared_routes(found, full)[0][3][0]
print("found:", [(len(p), type(t).__name__, a) for p, t, a in found], "route:", route, "metrics on:", metrics.enabled())
def copied():
    g = fresh()
    return fence_boundary._copied(g, scan(g, full), full)
parts = {
  "bare (new graph result)": fresh,
  "bare+scan": lambda: scan(fresh(), full),
  "bare+scan+routes": lambda: fence_boundary.shared_routes(scan(g := fresh(), full), full),
  "bare+scan+_copied": copied,
  "served (through the C check)": lambda: served.forward_batch_generation(None),
  "bare+walk": lambda: fence_boundary._walk(fresh(), full),
  "clone": lambda: logits.clone(),
  "_said_copy": lambda: fence_boundary._said_copy(route),
  "empty launch": lambda: torch.cuda._sleep(0),
}
parts_table(parts)
