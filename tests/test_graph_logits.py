"""The graph's logits, left in place only where nothing reads them after the worker returns.

0.5.23's decode graph hands the scheduler its logits as a slice of the graph's output, which the
next replay rewrites; the boundary check copies them unless logits_readers shows, from the engine's
code, that nothing reads `logits_output.next_token_logits` after the worker returns, and the rank's
first steps, watched, see no read. Every release's verdict is in docs/COMPATIBILITY.md, which
tests/test_compat_matrix.py recomputes. Here: doctored copies of 0.5.23 that do read them (or hide
where the result goes), each naming the place; the rule the native scan and the Python walk share
(that one route of those types, and no other, left in place); and the watch, which turns the copy
back on at a read.
"""

from __future__ import annotations

import pathlib
import types

import pytest

from sglang_dsv41_adapters.engine.installed import InstalledEngine
from sglang_dsv41_adapters.folded_fence import accept_snapshot, fence_boundary, holders, logits_readers
from bench.fence_host_cost import decode_result, dspark

pytestmark = pytest.mark.timeout(300)
BATCH_RESULTS = "sglang.srt.managers.scheduler_components.batch_result_processor"
SCHEDULER = "sglang.srt.managers.scheduler"
WORKER = "sglang.srt.speculative.dspark_components.dspark_worker_v2"
AFTER_DECODE = "        self.metrics_reporter.snapshot_spec_decode_metrics(batch, result)\n"


class Files:
    """An engine as its sources: the installed files, some replaced by doctored copies."""

    def __init__(self, files: dict):
        self._files = files

    def files(self) -> dict:
        return self._files


def doctored(tmp_path, module: str, old: str, new: str) -> Files:
    files = dict(InstalledEngine().files())
    text = pathlib.Path(files[module]).read_text(encoding="utf-8")
    assert text.count(old) == 1, f"doctoring {module}: {old!r} is not in the real source exactly once"
    path = tmp_path / (module.rpartition(".")[2] + "_doctored.py")
    path.write_text(text.replace(old, new), encoding="utf-8")
    files[module] = str(path)
    return Files(files)


# (module, old, new, the start of where it is said, what is said there)
LATE = {
    "processing a decode result reads them": (
        BATCH_RESULTS, AFTER_DECODE, AFTER_DECODE + "        result.logits_output.next_token_logits.sum()\n",
        "sglang/srt/managers/scheduler_components/batch_result_processor.py:",
        "reads logits_output.next_token_logits after the worker returns"),
    "read in a loop above the line that names them": (  # the function is read again once the local changes
        BATCH_RESULTS, AFTER_DECODE, AFTER_DECODE + "        seen = None\n        for _ in range(2):\n"
        "            if seen is not None:\n                seen.next_token_logits.sum()\n"
        "            seen = result.logits_output\n",
        "sglang/srt/managers/scheduler_components/batch_result_processor.py:",
        "reads logits_output.next_token_logits after the worker returns"),
    "read by a name given to getattr": (
        BATCH_RESULTS, AFTER_DECODE, AFTER_DECODE + "        getattr(result.logits_output, 'next_token_logits').sum()\n",
        "sglang/srt/managers/scheduler_components/batch_result_processor.py:",
        "reads logits_output.next_token_logits after the worker returns"),
    "the scheduler's result queue, read in another method": (
        SCHEDULER, "        flush_trace_batch(batch.reqs)\n",
        "        flush_trace_batch(batch.reqs)\n        self.peek_results()\n\n    def peek_results(self):\n"
        "        for _, queued in self.result_queue:\n            queued.logits_output.next_token_logits.float()\n\n"
        "    def _rest_of_process_batch_result(self, batch, result):\n",
        "sglang/srt/managers/scheduler.py:", "(Scheduler.peek_results) reads logits_output.next_token_logits"),
    "handed to code outside the engine": (
        BATCH_RESULTS, AFTER_DECODE, AFTER_DECODE + "        torch.save(result, '/dev/null')\n",
        "not shown unread: sglang/srt/managers/scheduler_components/batch_result_processor.py:",
        "passes a GenerationBatchResult to torch.save, which is torch.save, outside the engine"),
    "formatted as text": (
        BATCH_RESULTS, AFTER_DECODE, AFTER_DECODE + "        logger.debug(f'{result}')\n",
        "not shown unread: sglang/srt/managers/scheduler_components/batch_result_processor.py:",
        "formats a GenerationBatchResult as text"),
    "the worker keeps its logits output": (
        WORKER, "        logits_output = target_verify.logits_output\n",
        "        logits_output = target_verify.logits_output\n        self._last_logits_output = logits_output\n",
        "not shown unread: sglang/srt/speculative/dspark_components/dspark_worker_v2.py:",
        "keeps a LogitsProcessorOutput in self._last_logits_output, beyond the step"),
    "a decorator not shown to pass the result through": (
        SCHEDULER, "    @scheduler_stage_method(SCHEDULER_STAGE_PROCESS_BATCH_RESULT)\n    def process_batch_result(",
        "    @functools.lru_cache(maxsize=None)\n    def process_batch_result(",
        "not shown unread: sglang/srt/", "decorated by functools.lru_cache(maxsize=None), which is not shown"),
    "the result processor built by a factory": (
        SCHEDULER, "        self.batch_result_processor = SchedulerBatchResultProcessor(",
        "        self.batch_result_processor = make_processor(SchedulerBatchResultProcessor,",
        "not shown unread: sglang/srt/", "built by make_processor"),
}


@pytest.mark.parametrize("case", list(LATE))
def test_a_copy_that_reads_them_late_or_hides_where_they_go_keeps_the_copy(tmp_path, case):
    module, old, new, where, said = LATE[case]
    found = logits_readers.verdict(doctored(tmp_path, module, old, new))
    assert not found.unread and found.why.startswith(where) and said in found.why, found.why


def test_doctor_names_the_decision():
    from sglang_dsv41_adapters import folded_fence
    from sglang_dsv41_adapters.framework import runtime

    plan = folded_fence.check(InstalledEngine(), True, runtime.Context())
    assert plan.short_reason == "fenced 3 escape routes; graph logits left in place"
    assert "the graph's logits left in place where they leave the worker after a watched start: no code reads" in plan.detail


# --- at run time: the route left, every other copied; the watch --------------------------------------

@pytest.fixture(params=["python", "native"])
def epilogue(request):
    fence_boundary.reset()
    kernel = accept_snapshot.load(str(request.getfixturevalue("sm80")))[0] if request.param == "native" else None
    fence_boundary.use_native(kernel)
    logits_readers.decide(logits_readers._running((logits_readers.RESULT, logits_readers.LOGITS)))
    logits_readers.watched_for(0)
    yield dspark(8)[1]
    logits_readers.decide()
    fence_boundary.use_native()
    fence_boundary.reset()


def through_worker(result, epilogue):
    worker = types.SimpleNamespace(_verify_epilogue=epilogue)
    return fence_boundary.check_results(lambda _worker, batch: result, worker, (worker, None), {})


def held(obj, name):
    """An attribute read without the watch's property (the test's own reads are reads too)."""
    return vars(obj)[name]


def storage(tensor) -> int:
    return tensor.untyped_storage().data_ptr()


def test_the_result_logits_route_is_left_and_the_same_memory_elsewhere_is_copied(epilogue):
    graph = epilogue.commit_lens_buf  # any buffer of the epilogue stands for the graph's output
    for _ in range(3):  # the first steps map and bind; the later ones run as served
        result = decode_result(4)
        result.logits_output.next_token_logits = graph[:4]
        result.logits_output.hidden_states = graph[4:8]  # the same memory, another field: copied
        result.accept_lens = graph[:4]                   # the very tensor's memory, another route: copied
        out = through_worker(result, epilogue)
        assert out is result and storage(held(out.logits_output, "next_token_logits")) == storage(graph)
        assert storage(out.logits_output.hidden_states) != storage(graph)
        assert storage(out.accept_lens) != storage(graph)


def test_only_the_judged_types_are_left(epilogue):
    from sglang.srt.layers.logits_processor import LogitsProcessorOutput

    class Kept(LogitsProcessorOutput):  # a subclass may read it otherwise: copied
        pass

    graph = epilogue.commit_lens_buf
    for _ in range(2):
        result = decode_result(4)
        result.logits_output = Kept(next_token_logits=graph[:4])
        out = through_worker(result, epilogue)
        assert storage(out.logits_output.next_token_logits) != storage(graph)
        elsewhere = decode_result(4)  # a logits output of that type held by another attribute: copied
        elsewhere.peer = LogitsProcessorOutput(next_token_logits=graph[:4])
        out = through_worker(elsewhere, epilogue)
        assert storage(held(out.peer, "next_token_logits")) != storage(graph)
        aliased = decode_result(4)  # the result's own logits output, held under another attribute too: copied
        aliased.logits_output.next_token_logits = graph[:4]
        aliased.peer = aliased.logits_output
        out = through_worker(aliased, epilogue)
        assert storage(held(out.logits_output, "next_token_logits")) != storage(graph)


def test_the_watch_copies_first_and_a_late_read_turns_the_copy_back_on(epilogue, capsys):
    logits_readers.watched_for(2)
    graph = epilogue.commit_lens_buf

    def step():
        result = decode_result(4)
        result.logits_output.next_token_logits = graph[:4]
        return through_worker(result, epilogue)

    first = step()  # watched: copied
    assert storage(held(first.logits_output, "next_token_logits")) != storage(graph)
    if first.logits_output.next_token_logits is None:  # an identity test, not a read (an `if`: pytest rewrites asserts)
        raise AssertionError("the logits are gone")
    assert logits_readers.watching()
    second = step()
    assert not logits_readers.watching() and logits_readers.leaving() is not None
    left = step()  # the watch is over: left in place
    assert storage(held(left.logits_output, "next_token_logits")) == storage(graph)
    first.logits_output.next_token_logits.sum()  # a late read of a watched result
    assert logits_readers.leaving() is None
    again = step()
    assert storage(held(again.logits_output, "next_token_logits")) != storage(graph)
    err = capsys.readouterr().err
    assert "no read of logits_output.next_token_logits after the worker returned; the graph's logits are left in " \
           "place from now" in err
    assert f"{__file__}:" in err and "read logits_output.next_token_logits after the worker returned" in err
    del second


def test_the_pack_reading_them_is_not_a_read(epilogue):
    logits_readers.watched_for(1)
    result = decode_result(4)
    result.logits_output.next_token_logits = epilogue.commit_lens_buf[:4]
    out = through_worker(result, epilogue)
    fence_boundary._walk(out, epilogue)  # the pack's own walk reads every field
    list(holders.items(out.logits_output))
    assert logits_readers.leaving() is not None


def test_a_tree_that_differs_only_where_the_following_never_read_reuses_the_proof(tmp_path, monkeypatch):
    from sglang_dsv41_adapters.engine import proofs

    monkeypatch.setenv(proofs.ENV, str(tmp_path / "proofs"))  # a cache of this test's own: the installed tree judged here
    proofs.forget()
    installed = logits_readers.verdict(InstalledEngine())
    monkeypatch.setattr(logits_readers, "_judge", lambda files: pytest.fail("judged again"))
    files = dict(InstalledEngine().files())
    unread_module = "sglang.srt.entrypoints.openai.protocol"  # never on the result's path
    copy = tmp_path / "protocol.py"
    copy.write_text(pathlib.Path(files[unread_module]).read_text(encoding="utf-8") + "\n# doctored\n", encoding="utf-8")
    files[unread_module] = str(copy)
    assert logits_readers.verdict(Files(files)) == installed
