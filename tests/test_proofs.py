"""The proof cache (adapter.engine.proofs): a process reuses what an earlier one proved of the
same engine sources with the same pack and Python, and nothing else. A hit decides exactly
as proving does; a source that differs by one byte, a damaged entry, a folder that cannot be
written or a changed pack leaves the decision as proving makes it."""

from __future__ import annotations

import contextlib
import json
import os
import pathlib
import shutil
import subprocess
import sys
import time
import types

import pytest

from sglang_dsv41_adapters import ADAPTERS, load
from sglang_dsv41_adapters.engine import census, proofs
from sglang_dsv41_adapters.framework import runtime
from sglang_dsv41_adapters.framework.topology import Topology
from harness import zygote
from harness.doctored import DoctoredEngine, doctored_module, new_module_file
from harness.engines import ROOT, engine_env, python, release_sources
from tests.proof_cases import record

ENVIRON = {load(name).flag: load(name).check_value for name in ADAPTERS}
WORKER = "sglang.srt.speculative.dspark_components.dspark_worker_v2"


def cases(folder, *args: str) -> tuple[dict, str]:
    """tests.proof_cases in a fresh interpreter with the proof cache in `folder` ("off": none)."""
    done = zygote.run([python(), "-m", "tests.proof_cases", *args], cwd=ROOT,
                      env=engine_env("0.5.23", **{proofs.ENV: str(folder)}), capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    line = next(line for line in done.stdout.splitlines() if line.startswith("RESULT:"))
    return json.loads(line[len("RESULT:"):]), done.stderr


_PROVEN: dict = {}


def uncached(*args: str) -> dict:
    """tests.proof_cases with no proof cache (everything proven), once per tree for this module's tests."""
    if args not in _PROVEN:
        _PROVEN[args] = cases("off", *args)[0]
    return _PROVEN[args]


def kept(folder) -> dict:
    """The entries in `folder` and when each was written (the files' digests aside: their record
    is written again whenever a file's stat changed, as other test runs' hard links do)."""
    return {p.name: p.stat().st_mtime_ns for p in folder.iterdir() if not p.name.startswith("digests-")}


def as_a_later_process() -> None:
    """Forget what this process knows of the proofs (what it read, wrote and hashed, and the
    census's files per name): a later process has only the folders."""
    proofs.forget()
    census.reset()


@pytest.fixture
def cache(tmp_path, monkeypatch):
    """An empty proof cache of this test, nothing of it known to this process yet."""
    folder = tmp_path / "proofs"
    monkeypatch.setenv(proofs.ENV, str(folder))
    as_a_later_process()
    yield folder
    as_a_later_process()


def decided(engine=None) -> dict:
    return record(runtime.decide(ENVIRON, engine, topology=Topology(4)))


def proven(engine=None) -> dict:
    """The decision with no proof cache and nothing of it in this process."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv(proofs.ENV, "off")
        proofs.forget()
        return decided(engine)


@pytest.mark.parametrize("tree", [None, "0.5.21"], ids=["installed 0.5.23", "sources of 0.5.21"])
def test_a_hit_decides_exactly_as_proving_does(tmp_path, tree):
    args = [] if tree is None else [str(release_sources(tree))]
    first, _ = cases(tmp_path / "proofs", *args)
    written = kept(tmp_path / "proofs")
    second, _ = cases(tmp_path / "proofs", *args)
    assert first["decisions"] == uncached(*args)["decisions"]
    assert second["decisions"] == uncached(*args)["decisions"]
    assert any(name.startswith("census-holding-") for name in written)
    assert kept(tmp_path / "proofs") == written  # the second process proved nothing again


def test_one_byte_in_a_proven_source_is_proven_again(cache, tmp_path):
    before = decided()
    assert before["outcomes"][ADAPTERS.index("rank0_broadcast")]["state"] != "refused"
    worker = doctored_module(WORKER, ("SpecTpSync(get_dp_tp_group())", "SpecTpSync(get_dp_tp_grouq())"),
                             directory=tmp_path)
    after = decided(DoctoredEngine({WORKER: worker}))
    broadcast = after["outcomes"][ADAPTERS.index("rank0_broadcast")]
    assert (broadcast["state"], "SpecTpSync(get_dp_tp_grouq())" in broadcast["reason"]) == ("refused", True)
    assert after == proven(DoctoredEngine({WORKER: worker}))


def test_a_file_more_in_the_tree_is_read_by_the_census_again(cache, tmp_path):
    decided()  # the census of the installed tree, kept
    added = new_module_file("sglang.srt.late_reader", "def late(epilogue, bs):\n    return epilogue.read_accept(bs)\n",
                            directory=tmp_path)
    engine = DoctoredEngine({}, {"sglang.srt.late_reader": added})
    after = decided(engine)
    fence = after["outcomes"][ADAPTERS.index("folded_fence")]
    assert (fence["state"], f"{added}:2 refers to read_accept" in fence["reason"]) == ("refused", True)
    assert after == proven(engine)


def test_a_file_changed_in_place_with_its_time_put_back_is_hashed_again(cache, tmp_path, monkeypatch):
    monkeypatch.setattr(proofs, "RACY_NS", 0)  # record a file written just now (a test cannot wait for the clock)
    path = tmp_path / "sglang" / "module.py"
    path.parent.mkdir()
    path.write_bytes(b"VALUE = 1\n")
    first = proofs.file_digests([str(path)])
    assert proofs.get("digests", (str(tmp_path),)) != proofs.MISSING  # recorded under the folder holding sglang/
    stat = path.stat()
    time.sleep(0.05)  # past the file system's clock tick
    with open(path, "r+b") as handle:  # the same inode, the same size, then its modification time put back
        handle.write(b"VALUE = 2\n")
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    assert path.stat().st_mtime_ns == stat.st_mtime_ns and path.stat().st_size == stat.st_size
    as_a_later_process()  # it has only the record
    assert proofs.file_digests([str(path)]) != first == (proofs.digest(b"VALUE = 1\n"),)


def test_a_module_source_changed_on_disk_is_read_again(tmp_path, monkeypatch):
    """contract.module_source keeps a module's text while its file's stat stays the same (the
    same text object: its digest is found by identity), and reads it again once it changed."""
    from sglang_dsv41_adapters.engine import contract

    monkeypatch.setattr(proofs, "RACY_NS", 0)  # keep a file written just now (a test cannot wait for the clock)
    path = tmp_path / "late_module.py"
    path.write_text("VALUE = 1\n")
    module = types.ModuleType("late_module")
    module.__file__ = str(path)
    first = contract.module_source(module)
    assert first == "VALUE = 1\n" and contract.module_source(module) is first
    time.sleep(0.05)  # past the file system's clock tick
    path.write_text("VALUE = 22\n")
    assert contract.module_source(module) == "VALUE = 22\n"
    monkeypatch.setattr(proofs, "RACY_NS", 10**12)  # a file read as it may still change is read every time
    path.write_text("VALUE = 333\nOTHER = 4\n")  # two lines: each reading joins them anew
    read = contract.module_source(module)
    assert read == "VALUE = 333\nOTHER = 4\n" and contract.module_source(module) is not read


def test_a_file_changed_as_it_was_hashed_is_not_recorded(cache, tmp_path):
    path = tmp_path / "sglang" / "module.py"
    path.parent.mkdir()
    path.write_bytes(b"VALUE = 1\n")  # within RACY_NS of its hashing: it may change again in the same clock tick
    assert proofs.file_digests([str(path)]) == (proofs.digest(b"VALUE = 1\n"),)
    assert proofs.get("digests", (str(tmp_path),)) is proofs.MISSING


def test_a_damaged_or_foreign_entry_is_ignored_and_said_once(cache, capfd):
    before = decided()
    entries = sorted(p for p in cache.iterdir() if not p.name.startswith("digests-"))
    truncated, flipped, foreign, donor = entries[:4]
    truncated.write_bytes(truncated.read_bytes()[:40])
    data = bytearray(flipped.read_bytes())
    data[-3] ^= 0xFF
    flipped.write_bytes(bytes(data))
    foreign.write_bytes(donor.read_bytes())  # whole and sound, but another key's
    capfd.readouterr()
    as_a_later_process()
    assert decided() == before
    said = [line for line in capfd.readouterr().err.splitlines() if "proof cache" in line]
    assert len(said) == 1 and "corrupt or not its key's" in said[0], said
    as_a_later_process()
    assert decided() == before  # the entries were proven and written again: nothing more to say
    assert "proof cache" not in capfd.readouterr().err


def test_a_folder_that_cannot_be_made_decides_the_same_and_says_so_once(tmp_path, monkeypatch, capfd):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    monkeypatch.setenv(proofs.ENV, str(blocker / "proofs"))
    proofs.forget()
    capfd.readouterr()
    found = decided()
    said = [line for line in capfd.readouterr().err.splitlines() if "proof cache" in line]
    assert len(said) == 1 and "can be written" in said[0], said
    assert found == proven()


@contextlib.contextmanager
def read_only(folder):
    """`folder` made read-only for this user: by its mode, or for root (whom modes do not
    stop) by the immutable attribute."""
    if os.geteuid() != 0:
        folder.chmod(0o555)
        undo = lambda: folder.chmod(0o755)  # noqa: E731
    else:
        done = subprocess.run(["chattr", "+i", str(folder)], capture_output=True, text=True)
        if done.returncode != 0:
            pytest.skip(f"root ignores modes and cannot make {folder} immutable here: {done.stderr.strip()}")
        undo = lambda: subprocess.run(["chattr", "-i", str(folder)], check=True)  # noqa: E731
    try:
        yield
    finally:
        undo()


def test_a_read_only_folder_serves_what_it_holds_and_proves_the_rest(tmp_path):
    folder = tmp_path / "proofs"
    filled, _ = cases(folder)  # the image build's doctor --strict fills it
    tree = str(release_sources("0.5.21"))
    with read_only(folder):
        with pytest.raises(OSError):
            (folder / "probe").write_text("")
        served, said = cases(folder)
        others, said_too = cases(folder, tree)  # nothing of this tree is held: proven, kept nowhere
    assert served["decisions"] == filled["decisions"]
    assert others["decisions"] == uncached(tree)["decisions"]
    lines = [line for line in said_too.splitlines() if "proof cache" in line]
    assert len(lines) == 1 and "can be written" in lines[0], lines


def run_pack(pack_parent, code: str, folder) -> str:
    """`code` in an interpreter importing the pack from `pack_parent` (nothing of the engine)."""
    env = {**os.environ, "PYTHONPATH": str(pack_parent), proofs.ENV: str(folder)}
    done = subprocess.run([sys.executable, "-P", "-c", "from sglang_dsv41_adapters.engine import proofs\n" + code],
                          env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


def test_a_change_to_the_pack_itself_is_another_key(tmp_path):
    folder = tmp_path / "proofs"
    copy = tmp_path / "copy"
    shutil.copytree(ROOT / "adapter", copy / "sglang_dsv41_adapters", ignore=shutil.ignore_patterns("__pycache__"))
    store = "print(proofs.cached('probe', ('key',), lambda: 'proven by this pack'))"
    look = "print(proofs.get('probe', ('key',)) is proofs.MISSING)"
    assert run_pack(ROOT, store, folder) == "proven by this pack"
    assert run_pack(copy, look, folder) == "False"  # the same sources elsewhere: the same pack
    changed = copy / "sglang_dsv41_adapters" / "engine" / "files.py"
    changed.write_text(changed.read_text() + "#\n")
    assert run_pack(copy, look, folder) == "True"


def test_processes_writing_at_once_leave_only_whole_entries(tmp_path):
    folder = tmp_path / "proofs"
    code = ("import os\nvalue = tuple(range(20000)) + (os.getpid(),)\n"
            "for _ in range(40):\n    proofs.put('race', ('key',), value)\n"
            "    proofs.forget()\n    found = proofs.get('race', ('key',))\n"
            "    assert found is not proofs.MISSING and found[:20000] == value[:20000], found\n"
            "print(proofs.notes())")
    env = {**os.environ, "PYTHONPATH": str(ROOT), proofs.ENV: str(folder)}
    writers = [subprocess.Popen([sys.executable, "-P", "-c", "from sglang_dsv41_adapters.engine import proofs\n" + code],
                                env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for _ in range(6)]
    for writer in writers:
        out, err = writer.communicate(timeout=120)
        assert (writer.returncode, out.strip()) == (0, "[]"), err
    assert [p.name for p in folder.iterdir() if p.name.startswith(".")] == []  # no temporary file left


def test_a_folder_another_process_made_meanwhile_is_written_to(tmp_path, monkeypatch):
    """Ranks start at once: each finds the folder missing, and all but the first to make it find it made."""
    folder = tmp_path / "proofs"
    folder.mkdir(mode=0o755)
    real_exists = pathlib.Path.exists
    monkeypatch.setattr(pathlib.Path, "exists", lambda self: False if self == folder else real_exists(self))
    assert proofs._write(folder, "entry", b"data") and (folder / "entry").read_bytes() == b"data"


# --- a proof kept is a proof only where nobody else could have written it ----------------------------

def _forged_tree(tmp_path):
    """0.5.23 whose GroupCoordinator.broadcast returns a private copy: a fresh proof refuses
    the engine's own broadcast (DSV41_SPEC_TP_SYNC)."""
    from harness import next_release

    root = next_release.tree(tmp_path / "tree", (), "0.5.23")
    next_release.edit(root, "srt/distributed/parallel_state.py",
                      ("            )\n        return input_\n\n    def broadcast_object",
                       "            )\n        return input_.clone()\n\n    def broadcast_object"))
    return root


def _forge(folder, root) -> None:
    """What another user would write: the entry that says the group broadcast was shown."""
    source = (root / "sglang/srt/distributed/parallel_state.py").read_text(encoding="utf-8")
    name, material = proofs._name("spectpsync-shown", proofs.key_of(("group broadcast", source)))
    import hashlib
    import marshal

    payload = marshal.dumps((material, True))
    (folder / name).write_bytes(hashlib.sha256(payload).hexdigest().encode() + b"\n" + payload)
    return folder / name


def _judge(root, folder, monkeypatch, capsys):
    """The decision on `root` with the cache in `folder`, and the lines the process said."""
    from sglang_dsv41_adapters.engine.source_engine import SourceEngine

    monkeypatch.setenv(proofs.ENV, str(folder))
    proofs.forget()
    capsys.readouterr()
    outcome = runtime.decide({"DSV41_SPEC_TP_SYNC": "all"}, SourceEngine(root), names=("rank0_broadcast",),
                             topology=Topology(4, attn_dp_size=1)).outcomes[0]
    return outcome, capsys.readouterr().err.splitlines()


def test_a_forged_entry_is_used_only_where_no_other_user_could_have_written_it(tmp_path, monkeypatch, capsys):
    root = _forged_tree(tmp_path)
    fresh, _ = _judge(root, "off", monkeypatch, capsys)
    assert fresh.state == runtime.REFUSED and "GroupCoordinator.broadcast: no longer broadcasts its input" in fresh.reason
    # In a folder of this user's own the entry is trusted: the forgery would work there (the test is not vacuous).
    own = tmp_path / "own"
    own.mkdir(mode=0o755)
    os.chmod(own, 0o755)
    _forge(own, root)
    trusted, _ = _judge(root, own, monkeypatch, capsys)
    assert trusted.state == runtime.SUPERSEDED, trusted.reason
    # A world-writable folder (a shared cache any user can write): not used, said once, proven again.
    shared = tmp_path / "shared"
    shared.mkdir()
    os.chmod(shared, 0o777)
    _forge(shared, root)
    outcome, notes = _judge(root, shared, monkeypatch, capsys)
    assert outcome.state == runtime.REFUSED and outcome.reason == fresh.reason
    (note,) = [n for n in notes if str(shared) in n]
    assert "can be written by other users (mode 777)" in note and "the proofs are made again" in note
    # Nothing was written there either.
    before = sorted(p.name for p in shared.iterdir())
    _judge(_forged_tree(tmp_path / "again"), shared, monkeypatch, capsys)
    assert sorted(p.name for p in shared.iterdir()) == before


@pytest.mark.skipif(not hasattr(os, "geteuid") or os.geteuid() != 0, reason="giving a file to another uid needs root")
def test_an_entry_another_user_wrote_is_not_used(tmp_path, monkeypatch, capsys):
    root = _forged_tree(tmp_path)
    folder = tmp_path / "cache"
    folder.mkdir()
    os.chmod(folder, 0o755)
    entry = _forge(folder, root)
    os.chown(entry, 4242, 4242)  # another user's entry, in a folder this user owns
    outcome, notes = _judge(root, folder, monkeypatch, capsys)
    assert outcome.state == runtime.REFUSED and "GroupCoordinator.broadcast" in outcome.reason
    assert any("belongs to uid 4242, not to this user" in n for n in notes), notes
