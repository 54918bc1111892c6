"""The pack's report site 30:pack-decode-graph-key: the decode graph key a target forward
replays, compared across the TP ranks (ranks that replay different graphs diverge or hang, and
no release compares the key; upstream PR sgl-project/sglang#31195, open, compares the
per-rank `Decode graph replay: worker=target key_size=...` log lines).

The key is what `DecodeCudaGraphRunner.load_batch` picks (`self._replay_graph_key =
self._make_graph_key(graph_size_key, ...)`: the padded batch size, or under ragged verify
the token tier of the verify budget) and `execute` replays (`self.backend.replay(
self._replay_graph_key, ...)`). No rank broadcasts it, so the report sends rank 0's: one
int64 broadcast per decode step over the ranks that run one batch, compared with this rank's by
`divergence.observe` like the broadcast sites. A forward that ran eager compares 0 (EAGER),
so a rank that replays while another runs eager (can_run_graph differs) is counted too.

Where: around `ModelRunner._forward_raw`, after it returns, on the target worker only, at
the forwards where `_forward_raw` takes the decode graph decision (`mode_check()`:
forward_mode.is_cuda_graph, is_cpu_graph on a CPU device). Every rank passes that point
once per such forward whatever the decision was: the decision (`can_run_graph`) and both of
its outcomes (`decode_cuda_graph_runner.execute`, or the eager/prefill-graph branches) lie
inside `_forward_raw`:

    release  def _forward_raw  can_run_graph  execute       (model_runner.py)
    0.5.16   1376              1396           1409
    0.5.17   1526              1546           1559
    0.5.18   1641              1661           1674
    0.5.19   1712              1732           1745
    0.5.20   1774              1794           1807
    0.5.21   1856              1876           1889
    0.5.22   1932              1952           1965
    0.5.23   1963              1994           2007

A broadcast placed on the replay path (in `execute` or `load_batch`) would pair, on a rank
that ran eager, with the first collective of its eager forward. `load_batch` is also called
outside a forward (the pre-planned verify: eagle_utils.py 406, dflash_info.py 125 in
0.5.23), and `can_run_graph` by the speculative workers at their own sites: neither is a
point every rank passes once per step. After the forward, every collective of the forward
has been issued on every rank: the compare pairs only with itself. What it cannot count is
a step whose differing keys already hang the replay's own collectives (the engine's
SGLANG_LOG_DECODE_GRAPH_KEY line, printed before the replay, names that one).

`DecodeCudaGraphRunner.execute` is wrapped only to note the key it replayed (host, no
collective). The group is the one whose ranks run one batch (`batch_group`: the
attention-TP group under DP attention, else the TP group, read from the live topology): the
divergence compared is of ranks that hold one batch, never of two DP groups' batches.
The report off: nothing is patched.
"""

from __future__ import annotations

import functools

from ..engine import parallel_groups
from ..engine.contract import POSITIONAL, Contract, target_modules
from ..framework.plan import Patch, Plan
from ..spectpsync.sites import Site
from . import divergence

NAME = "tp_divergence"
SITE = Site.PACK_DECODE_GRAPH_KEY
EAGER = 0  # compared by a forward that did not replay the decode graph (no key is 0)
MODEL_RUNNER = "sglang.srt.model_executor.model_runner"
GRAPH_RUNNER = "sglang.srt.model_executor.runner.decode_cuda_graph_runner"
FORWARD = "ModelRunner._forward_raw"
EXECUTE = "DecodeCudaGraphRunner.execute"
# What the sources must say for the placement above to hold (refused otherwise, symbol named).
SHOWN = {
    FORWARD: ("self.decode_cuda_graph_runner.can_run_graph(forward_batch)",
              "self.decode_cuda_graph_runner.execute(", "forward_batch.forward_mode.is_cuda_graph",
              "forward_batch.forward_mode.is_cpu_graph"),
    EXECUTE: ("self.load_batch(forward_batch", "self.backend.replay(self._replay_graph_key"),
    "DecodeCudaGraphRunner.load_batch": ("self._replay_graph_key = self._make_graph_key(",),
    "DecodeCudaGraphRunner._make_graph_key": ("size=size",),
}

_replayed = None  # (graph runner, key size) of the last execute
_get_parallel = None  # the engine's runtime_context.get_parallel, imported at the first compared step


def _forward_batch(forward_batch, *args, **kwargs):
    return forward_batch


def note_replayed(wrapped, instance, args, kwargs):
    """Around DecodeCudaGraphRunner.execute: the key size it replayed, kept on the host."""
    global _replayed
    result = wrapped(*args, **kwargs)
    _replayed = (instance, instance._replay_graph_key.size)
    return result


def batch_group():
    """The ranks that run one batch, from the live topology: the attention-TP group where it
    is narrower than the TP group (DP attention), else the TP group. Not from the server
    arguments: 0.5.23 resolves --enable-dp-attention into attn_dp_size and leaves
    enable_dp_attention false. With attention context parallelism and no DP attention the
    attention-TP group is narrower too: the compare then covers fewer ranks, never ranks that
    run another batch. Both names are shown at plan time (engine.parallel_groups)."""
    global _get_parallel
    if _get_parallel is None:
        from sglang.srt.runtime_context import get_parallel as _get_parallel
    parallel = _get_parallel()
    attention = parallel.attn_tp_group
    return attention if attention.world_size < parallel.tp_group.world_size else parallel.tp_group


def compare_forward(every, batch_group, wrapped, instance, args, kwargs, abort=False):
    """Around ModelRunner._forward_raw: after a target forward that took the decode graph
    decision, rank 0's replayed key (EAGER if none) broadcast and compared with this rank's."""
    global _replayed
    runner = instance.decode_cuda_graph_runner
    if runner is None or instance.is_draft_worker:
        return wrapped(*args, **kwargs)
    mode = _forward_batch(*args, **kwargs).forward_mode
    decided = (mode.is_cpu_graph if instance.device == "cpu" else mode.is_cuda_graph)()  # the engine's mode_check
    _replayed = None
    result = wrapped(*args, **kwargs)
    group = batch_group()
    if decided and group.world_size > 1:
        import torch

        divergence.raise_if_stopped()  # a stopped rank enters no collective rank 0 does not
        key = _replayed[1] if _replayed is not None and _replayed[0] is runner else EAGER
        mine = torch.full((1,), key, dtype=torch.int64, device=group.device)  # a fill: no host copy, no sync
        theirs = mine if group.rank_in_group == 0 else torch.empty_like(mine)  # rank 0 sends its own
        group.broadcast(theirs, src=0)
        divergence.observe(*divergence.label(SITE), (mine,), (theirs,), every, abort)
    return result


def plan(engine, every: int, abort: bool = False) -> Plan:
    """The two patches, once the sources show the placement holds on `engine`."""
    modules = target_modules(NAME, engine, ((MODEL_RUNNER, True), (GRAPH_RUNNER, True)))
    runner, graph = Contract(NAME, modules[MODEL_RUNNER]), Contract(NAME, modules[GRAPH_RUNNER])
    runner.params(FORWARD, {"forward_batch": POSITIONAL})
    graph.params(EXECUTE, {"forward_batch": POSITIONAL})
    for symbol, needles in SHOWN.items():
        contract = runner if symbol == FORWARD else graph
        source = contract.function_source(symbol)
        for needle in needles:
            if needle not in source:
                raise contract.refuse(symbol, f"no longer reads `{needle}`: the decode graph key compared at "
                                              f"{SITE.label} is not shown to be the one replayed, after a decision "
                                              "every rank takes")
    detail = (f"compares {SITE.label} (the decode graph key a target forward replays, {EAGER} for eager) after "
              f"{MODEL_RUNNER}.{FORWARD} at every forward that takes the decode graph decision, over the ranks that "
              "run one batch (attention-TP under DP attention, else TP): one int64 broadcast per decode step; "
              f"the groups: {parallel_groups.check(NAME, engine)}")
    compare = functools.partial(compare_forward, every, batch_group, abort=abort)
    return Plan("applied", detail, [Patch(runner.attr("ModelRunner"), "_forward_raw", compare),
                                    Patch(graph.attr("DecodeCudaGraphRunner"), "execute", note_replayed)],
                short_reason=f"{int(SITE)} (decode graph key)")
