"""`doctor --engine PATH` reads untrusted input: only regular files, within size limits,
and a path it cannot use is one line on stderr with a non-zero exit, never a traceback
or a hang."""

from __future__ import annotations

import os
import pathlib
import subprocess
import zipfile

import pytest

from sglang_dsv41_adapters.engine import source_engine
from sglang_dsv41_adapters.engine.source_engine import EngineSourceError, SourceEngine, open_engine, unpack_wheel
from sglang_dsv41_adapters.cli import EXIT_USAGE
from harness.engines import ROOT, engine_env, linked_copy, python, release_sources, release_wheel
from harness import zygote
from tests.log_lines import untimed


def doctor_engine(path) -> subprocess.CompletedProcess:
    # The timeout turns a hang (a FIFO opened for reading) into a failure.
    return zygote.run([python(), "entrypoint.py", "doctor", "--engine", str(path)], cwd=ROOT,
                          env=engine_env("0.5.23"), capture_output=True, text=True, timeout=120)


def assert_one_line_error(done: subprocess.CompletedProcess, *parts: str) -> None:
    assert done.returncode == EXIT_USAGE, (done.stdout, done.stderr)
    assert done.stdout == ""
    lines = untimed(done.stderr)
    assert len(lines) == 1 and "Traceback" not in done.stderr, done.stderr
    assert lines[0].startswith(f"[sglang-adapters] pid={lines[0].split()[1][4:]} rank=launcher doctor --engine "
                               f"{done.args[-1]}: ")
    for part in parts:
        assert part in lines[0]


def folder_engine(root: pathlib.Path) -> pathlib.Path:
    (root / "sglang" / "srt").mkdir(parents=True)
    (root / "sglang" / "__init__.py").write_text("")
    (root / "sglang" / "version.py").write_text('__version__ = "0.5.23"\n')
    return root


def wheel(path: pathlib.Path, members: dict[str, bytes]) -> pathlib.Path:
    with zipfile.ZipFile(path, "w", compression=zipfile.ZIP_DEFLATED) as archive:
        for name, data in members.items():
            archive.writestr(name, data)
    return path


def written(folder: pathlib.Path) -> int:
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())


def test_a_fifo_named_like_a_module_is_refused_not_opened(tmp_path):
    root = folder_engine(tmp_path / "engine")
    os.mkfifo(root / "sglang" / "srt" / "x.py")
    done = doctor_engine(root)
    assert_one_line_error(done, str(root / "sglang" / "srt" / "x.py"), "not a regular file (FIFO, device or socket)",
                          "reads only regular files")


def test_a_symbolic_link_in_the_tree_is_refused(tmp_path):
    root = folder_engine(tmp_path / "engine")
    (tmp_path / "elsewhere.py").write_text("x = 1\n")
    (root / "sglang" / "srt" / "linked.py").symlink_to(tmp_path / "elsewhere.py")
    with pytest.raises(EngineSourceError, match="linked.py is a symbolic link: doctor --engine reads only regular files"):
        SourceEngine(root)
    (root / "sglang" / "srt" / "linked.py").unlink()
    (root / "sglang" / "srt" / "folder").symlink_to(tmp_path, target_is_directory=True)
    with pytest.raises(EngineSourceError, match="folder is a symbolic link"):
        SourceEngine(root)


def test_an_oversize_file_in_a_folder_engine_is_refused(tmp_path, monkeypatch):
    root = folder_engine(tmp_path / "engine")
    (root / "sglang" / "srt" / "big.py").write_bytes(b"#" * 2048)
    monkeypatch.setattr(source_engine, "MEMBER_LIMIT", 1024)
    with pytest.raises(EngineSourceError, match="big.py is 2048 bytes, over the per-file limit"):
        SourceEngine(root)


def test_a_zip_bomb_member_is_refused_with_the_limit_named_and_nothing_left_behind(tmp_path):
    big = b"#" * (source_engine.MEMBER_LIMIT * 2)  # 8 MiB of comment, a few KB compressed
    bomb = wheel(tmp_path / "sglang-0.5.23-py3-none-any.whl", {"sglang/__init__.py": b"", "sglang/srt/big.py": big})
    assert bomb.stat().st_size < 64 * 1024
    done = doctor_engine(bomb)
    assert_one_line_error(done, "member sglang/srt/big.py unpacks to more than the per-member limit of 4 MiB",
                          "MEMBER_LIMIT")
    # In process: what was written before the refusal stays within the limit.
    into = tmp_path / "unpacked"
    with pytest.raises(EngineSourceError, match="per-member limit"):
        unpack_wheel(bomb, into)
    assert written(into) <= source_engine.MEMBER_LIMIT
    # open_engine clears what it had unpacked.
    workdir = tmp_path / "work"
    workdir.mkdir()
    with pytest.raises(EngineSourceError):
        open_engine(bomb, workdir)
    assert written(workdir) == 0


def test_the_total_limit_is_counted_while_writing(tmp_path, monkeypatch):
    monkeypatch.setattr(source_engine, "TOTAL_LIMIT", 3 << 20)
    members = {f"sglang/m{i}.py": b"#" * (1 << 20) for i in range(5)}
    into = tmp_path / "unpacked"
    with pytest.raises(EngineSourceError, match="unpack to more than the total limit of 3 MiB"):
        unpack_wheel(wheel(tmp_path / "w.whl", members), into)
    assert written(into) <= 3 << 20


def test_a_member_outside_the_wheel_is_refused(tmp_path):
    bad = wheel(tmp_path / "w.whl", {"sglang/../../escaped.py": b"x = 1\n"})
    with pytest.raises(EngineSourceError, match="points outside the wheel"):
        unpack_wheel(bad, tmp_path / "unpacked")
    assert not (tmp_path / "escaped.py").exists()


def test_a_missing_path_is_one_line(tmp_path):
    done = doctor_engine(tmp_path / "no-such-engine")
    assert_one_line_error(done, "no-such-engine does not exist")


def test_a_corrupt_wheel_is_one_line(tmp_path):
    corrupt = tmp_path / "sglang-0.5.23-py3-none-any.whl"
    corrupt.write_bytes(b"PK\x03\x04 this is not a zip archive" * 100)
    done = doctor_engine(corrupt)
    assert_one_line_error(done, "is not a readable wheel: BadZipFile")


def test_a_folder_without_sglang_is_one_line(tmp_path):
    done = doctor_engine(tmp_path)
    assert_one_line_error(done, "holds no sglang/ source tree")


def test_the_real_0_5_23_wheel_unpacks_within_the_limits(tmp_path):
    real = release_wheel("0.5.23")
    with zipfile.ZipFile(real) as archive:
        sources = [i for i in archive.infolist() if i.filename.startswith("sglang/") and i.filename.endswith(".py")]
    engine = open_engine(real, tmp_path)
    assert engine.version == "0.5.23"
    unpacked = [p for p in engine.root.rglob("*") if p.is_file()]
    # Only the sources (the Python, and the kernel sources adapters read) and the metadata (its RECORD ties it
    # to them): no binaries.
    kernels = [p for p in unpacked if p.suffix not in (".py", "") and p.name not in ("METADATA", "RECORD")]
    assert [str(p.relative_to(engine.root)) for p in kernels] == ["sglang/kernels/jit/csrc/deepseek_v4/c_plan.cuh"]
    assert len([p for p in unpacked if p.suffix == ".py"]) == len(sources)
    # Headroom the limits keep over the real release.
    assert max(i.file_size for i in sources) * 4 < source_engine.MEMBER_LIMIT
    assert sum(i.file_size for i in sources) * 3 < source_engine.TOTAL_LIMIT


def test_a_module_that_does_not_parse_is_an_error_naming_its_file_and_line(tmp_path):
    """A module of the tree that is not Python raises SyntaxError naming the file and the line,
    each time it is asked (the checks that read it refuse with that reason); the tree's other
    modules still read."""
    root = folder_engine(tmp_path / "tree")
    (root / "sglang" / "srt" / "good.py").write_text("def fine(x):\n    return x\n")
    (root / "sglang" / "srt" / "broken.py").write_text("VALUE = 1\ndef broken(:\n    pass\n")
    engine = SourceEngine(root)
    for _ in range(2):  # asked again (another adapter's check), it is the same error, not an empty module
        with pytest.raises(SyntaxError) as raised:
            engine.module("sglang.srt.broken")
        assert (raised.value.filename, raised.value.lineno) == (str(root / "sglang" / "srt" / "broken.py"), 2)
    assert engine.module("sglang.srt.good").fine.__source_text__ == "def fine(x):\n    return x"


def test_a_release_module_that_does_not_parse_is_named_by_every_check_that_reads_it(tmp_path):
    """0.5.23's sources with its DSpark worker made unparsable: every adapter whose check reads
    that module refuses naming the SyntaxError and its line, not a symbol gone missing."""
    from sglang_dsv41_adapters import ADAPTERS, load
    from sglang_dsv41_adapters.framework import runtime
    from sglang_dsv41_adapters.framework.topology import Topology

    root = tmp_path / "tree"
    linked_copy(release_sources("0.5.23") / "sglang", root / "sglang")
    worker = root / "sglang" / "srt" / "speculative" / "dspark_components" / "dspark_worker_v2.py"
    text = worker.read_text()
    worker.unlink()  # a file of its own: the others stay linked
    worker.write_text(text.replace("class DSparkWorkerV2", "class DSparkWorkerV2(:", 1))
    line = text[:text.index("class DSparkWorkerV2")].count("\n") + 1
    decision = runtime.decide({load(n).flag: load(n).check_value for n in ADAPTERS}, SourceEngine(root),
                              topology=Topology(4))
    reasons = {o.adapter: (o.state, o.reason) for o in decision.outcomes}
    for adapter in ("folded_fence", "rank0_broadcast", "group_min_memory", "tp_divergence"):
        state, reason = reasons[adapter]
        assert state == "refused" and f"SyntaxError: invalid syntax (dspark_worker_v2.py, line {line})" in reason, \
            (adapter, reason)
