"""Diagnostic: the parts of the fenced, checked step in fence_cost's setting (GPU), bs 8."""
import os, statistics, sys, time, subprocess
sys.path.insert(0, os.getcwd())
import torch, wrapt
from sglang_dsv41_adapters.folded_fence import accept_snapshot, fence_boundary
from bench import fence_cost as fc
from bench.fence_host_cost import captured, decode_result, parts_table, rebuilt, worker_of
from harness.fence import fence_on, folded_kwargs

kernel = sys.argv[1]
lib = accept_snapshot.imported(kernel) if len(sys.argv) > 2 else accept_snapshot.load(kernel)[0]
if torch.cuda.is_available():
    verify, epilogue, executor, device = fc.build(256)
    full = fc.build(256)[1]
else:
    from bench.fence_host_cost import dspark
    verify, epilogue, executor = dspark(256); device = torch.device("cpu"); full = dspark(256)[1]
    torch.cuda.synchronize = lambda: None
captured(full)
fence_boundary.use_native(lib)
bs = 8
kw = folded_kwargs(bs, device)
result = decode_result(bs, device=device)
new = lambda self, batch: rebuilt(result)
served, bare = worker_of(full, new), worker_of(full, new, checked=False)
noop = type("W", (), {"_verify_epilogue": full, "forward_batch_generation": wrapt.FunctionWrapper(new, fc.call_through)})()
if device.type == "cuda":
    fence_on(); accept_snapshot.use_extension(True)
served.forward_batch_generation(None)
scan = fence_boundary._storages[id(full)][4]
assert scan(None, full)
accept = lambda: executor.accept_and_finalize(**kw)
big = torch.zeros((int(os.environ.get("THRASH_MB", "8")) << 20) // 8, dtype=torch.int64)
def thr(): big.add_(1)
small = torch.zeros((1 << 20) // 8, dtype=torch.int64)
def thr1(): small.add_(1)
def fresh(): return bare.forward_batch_generation(None)
parts = {
  "accept": accept,
  "accept+bare": lambda: (accept(), fresh()),
  "accept+served": lambda: (accept(), served.forward_batch_generation(None)),
  "accept+noopwrapt": lambda: (accept(), noop.forward_batch_generation(None)),
  "accept+bare+scanNone": lambda: (accept(), fresh(), scan(None, full)),
  "accept+scanres": lambda: (accept(), scan(fresh(), full)),
  "hot scanNone": lambda: scan(None, full),
  "hot scan(result)": lambda: scan(result, full),
  "hot bare": fresh,
  "hot served": lambda: served.forward_batch_generation(None),
  "thr": thr,
  "thr1": thr1,
  "thr1+scanNone": lambda: (thr1(), scan(None, full)),
  "thr+scanNone": lambda: (thr(), scan(None, full)),
}
parts_table(parts, calls=lambda name: 100 if name.startswith("thr") else 500)
