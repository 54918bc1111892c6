"""Ranks over a real multi-process group, NCCL on GPUs and gloo on the CPU, for the NCCL
tests (tests/tp_nccl_cases.py) and the NCCL benchmark (bench/tp_nccl_cost.py).

`spawn_ranks` starts one process per rank with torch.multiprocessing (world = all visible
GPUs on the GPU machine), joins them in a gloo default group and runs a target there; the
device group is NCCL on GPUs, gloo on the CPU. `make_group` builds the TP group the sites
broadcast over: sglang 0.5.23's own GroupCoordinator (pynccl on GPUs, as its TP group),
or, where that cannot be built, plain torch.distributed NCCL wrapped as SpecTpSync and the
pack's broadcast expect; the kind used is in every result. Every process gets NVLink
multicast switched off (NO_MULTICAST): it can put the shared GPUs out of service.
"""

from __future__ import annotations

import contextlib
import inspect
import json
import os
import pathlib
import tempfile
import time
import types

import torch

NO_MULTICAST = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}


# ---------------------------------------------------------------- processes


def _child(rank, world, rendezvous, nccl, target, kwargs, outdir, path):
    os.environ.update(NO_MULTICAST)
    import importlib
    import sys

    sys.path[:0] = path  # before anything imports sglang: spawn hands the child the parent's sys.path

    import torch.distributed as dist

    if nccl:
        torch.cuda.set_device(rank)
    dist.init_process_group("gloo", rank=rank, world_size=world, init_method=rendezvous)
    module, name = target.split(":")
    result = getattr(importlib.import_module(module), name)(rank, world, nccl=nccl, **kwargs)
    pathlib.Path(outdir, f"rank{rank}.json").write_text(json.dumps(result))
    dist.barrier()
    dist.destroy_process_group()


def spawn_ranks(world: int, target: str, *, nccl: bool, kwargs: dict | None = None, timeout: float = 180,
                path: list[str] = ()) -> list:
    """Each rank's result of target(rank, world, nccl=..., **kwargs), one process per rank;
    `path` goes first on each rank's sys.path (another engine release)."""
    import torch.multiprocessing as mp

    os.environ.update(NO_MULTICAST)  # inherited by the children too, before they import anything
    with tempfile.TemporaryDirectory() as outdir:
        # A file in the run's own folder, not a TCP port: a free port picked here can be taken
        # before the children bind it (seen on the GPU machine between two runs).
        rendezvous = f"file://{outdir}/rendezvous"
        if not nccl:
            _gloo_ranks(world, (rendezvous, target, kwargs or {}, outdir), timeout, list(path))
            return [json.loads(pathlib.Path(outdir, f"rank{r}.json").read_text()) for r in range(world)]
        ctx = mp.start_processes(_child, args=(world, rendezvous, nccl, target, kwargs or {}, outdir, list(path)),
                                 nprocs=world, join=False, start_method="spawn")
        deadline = time.monotonic() + timeout
        try:
            while not ctx.join(timeout=max(1.0, deadline - time.monotonic())):
                if time.monotonic() >= deadline:
                    raise AssertionError(f"{target} did not finish within {timeout}s on {world} ranks "
                                         f"(a hang in a collective?)")
        finally:
            for proc in ctx.processes:
                if proc.is_alive():
                    proc.kill()
        return [json.loads(pathlib.Path(outdir, f"rank{r}.json").read_text()) for r in range(world)]


def _gloo_ranks(world: int, job: tuple, timeout: float, path: list) -> None:
    """The CPU ranks: the same child, started from a zygote (harness/zygote.py) that has
    imported the release `path` selects, instead of a spawn that imports it again per rank."""
    import subprocess
    import sys

    from . import zygote
    from .engines import ROOT
    from .ranks import finish

    env = dict(os.environ, **NO_MULTICAST)
    env["PYTHONPATH"] = os.pathsep.join([*path, str(ROOT), *filter(None, [env.get("PYTHONPATH")])])
    procs = [zygote.popen([sys.executable, "-m", "harness.nccl", json.dumps([rank, world, *job])], cwd=ROOT, env=env,
                          stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True) for rank in range(world)]
    for rank, (code, _, err) in enumerate(finish(procs, job[1], timeout)):
        if code != 0:
            raise AssertionError(f"rank {rank} of {job[1]} failed (exit {code}):\n{err[-4000:]}")


# ---------------------------------------------------------------- the TP group


class TorchNcclGroup:
    """Fallback TP group: a torch.distributed NCCL group with what SpecTpSync and the pack's
    broadcast use (.broadcast(t, src=0), .world_size, .rank_in_group) and a graph_capture
    context like GroupCoordinator's (a side stream)."""

    def __init__(self, world: int):
        import torch.distributed as dist

        self.ranks = list(range(world))
        self.device_group = dist.new_group(self.ranks, backend="nccl")
        self.world_size, self.rank_in_group = world, dist.get_rank()

    def broadcast(self, tensor, src=0):
        import torch.distributed as dist

        dist.broadcast(tensor, src=self.ranks[src], group=self.device_group)
        return tensor

    @contextlib.contextmanager
    def graph_capture(self):
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            yield types.SimpleNamespace(stream=stream)


def make_group(rank: int, world: int, nccl: bool):
    """(group, kind): sglang's GroupCoordinator as its TP group is built (pynccl on, custom
    all-reduce and every other side channel off), else the torch.distributed fallback."""
    try:
        from sglang.srt.distributed.parallel_state import GroupCoordinator

        wanted = dict(group_ranks=[list(range(world))], local_rank=rank,
                      torch_distributed_backend="nccl" if nccl else "gloo", group_name="tp")
        for name in inspect.signature(GroupCoordinator.__init__).parameters:
            if name.startswith("use_"):
                wanted[name] = nccl and name == "use_pynccl"
        group = GroupCoordinator(**wanted)
        if nccl and not getattr(group.pynccl_comm, "available", False):  # graph_capture would call a missing libnccl
            raise RuntimeError("GroupCoordinator built without a working pynccl communicator (libnccl.so.2 not loaded?)")
        return group, "sglang GroupCoordinator" + (" (pynccl in graphs, torch NCCL eager)" if nccl else " (gloo)")
    except Exception as exc:  # noqa: BLE001 - reported in the result, the fallback still measures
        if not nccl:
            raise
        why = f"{type(exc).__name__}: {exc}".splitlines()[0][:300]
        return TorchNcclGroup(world), f"torch.distributed NCCL fallback (sglang GroupCoordinator failed: {why})"


def capture(group, region, nccl: bool):
    """A CUDA graph of `region`, captured as sglang's graph runners do: inside the group's
    graph_capture context, after an eager warm-up on the capture stream (which also makes
    the divergence counters). On the CPU: None (replays become eager calls)."""
    if not nccl:
        return None
    with group.graph_capture() as context:
        region()
        context.stream.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=context.stream):
            region()
    torch.cuda.synchronize()
    return graph


def run(graph, region):
    if graph is None:
        region()
    else:
        graph.replay()


@contextlib.contextmanager
def no_host_sync(nccl: bool):
    """Any host synchronisation raises (CUDA only)."""
    if not nccl:
        yield
        return
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode("default")


def device_of(group, nccl: bool):
    return torch.device("cuda", torch.cuda.current_device()) if nccl else torch.device("cpu")


def switch(adapter, environ: dict) -> str:
    """`adapter` alone decided and applied for `environ` as every rank does (the installed
    engine judged without the plugin-delivery check: the pack sits on the path, not
    installed); it must come out applied when `environ` sets its flag, else off."""
    from sglang_dsv41_adapters.framework import runtime
    from harness.doctored import DoctoredEngine

    decision = runtime.decide(environ, DoctoredEngine({}), names=(adapter.NAME,))
    runtime.apply(decision)
    outcome = decision.outcomes[0]
    want = runtime.APPLIED if environ.get(adapter.FLAG) else runtime.OFF
    if outcome.state != want:
        raise RuntimeError(f"{adapter.NAME} is {outcome.state}, not {want}: {outcome.reason}")
    return outcome.state


def report(on: bool, every: int = 8) -> None:
    """The divergence report switched on or off through the runtime, as every rank does."""
    from sglang_dsv41_adapters import tp_divergence as t

    switch(t, {t.FLAG: "1", t.EVERY_FLAG: str(every)} if on else {})


if __name__ == "__main__":  # a CPU rank of _gloo_ranks
    import sys

    rank, world, rendezvous, target, kwargs, outdir = json.loads(sys.argv[1])
    _child(rank, world, rendezvous, False, target, kwargs, outdir, [])
