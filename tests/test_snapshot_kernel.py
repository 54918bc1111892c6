"""The fence's prebuilt kernel file, on the CPU: how accept_snapshot loads it and why it falls back.

No GPU here, so `copy_mode()` itself says "no CUDA"; the loader's decision for a GPU is tested
through `_probe(path, capability)` with the capability such a GPU reports. Where a CUDA compiler
is found (CUDA_HOME, else /usr/local/cuda), a real kernel file is built once for sm_80 with the
command the image build runs (`sglang-adapters build-kernel`) and loaded by path.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import shutil

import msgspec
import pytest
import torch

from sglang_dsv41_adapters.folded_fence import accept_snapshot
from tests.conftest import build_kernel, cuda_home  # the `sm80` fixture (a real kernel file) is shared from conftest too
from tests.log_lines import untimed

ROOT = Path(__file__).resolve().parent.parent
pytestmark = pytest.mark.timeout(300)


# --- without a kernel file ---------------------------------------------------------------

def test_copy_mode_without_cuda_says_so_and_compiles_nothing(tmp_path):
    """In a fresh interpreter: no GPU, so clones, "no CUDA"; torch's compiler machinery is not
    even imported, and nothing is written."""
    code = ("import sys; from sglang_dsv41_adapters.folded_fence import accept_snapshot as a; print(a.copy_mode());"
            "print('torch.utils.cpp_extension' in sys.modules)")
    env = {**os.environ, "PYTHONPATH": str(ROOT), "CUDA_VISIBLE_DEVICES": "",
           accept_snapshot.PATH_ENV: str(tmp_path / "k.so"), "HOME": str(tmp_path), "PYTHONDONTWRITEBYTECODE": "1"}
    done = subprocess.run([sys.executable, "-P", "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split("\n")[:2] == ["('clones', 'no CUDA')", "False"]
    assert list(tmp_path.iterdir()) == []


def test_the_path_comes_from_the_environment(monkeypatch):
    monkeypatch.delenv(accept_snapshot.PATH_ENV, raising=False)
    assert accept_snapshot.kernel_path() == accept_snapshot.DEFAULT_PATH
    monkeypatch.setenv(accept_snapshot.PATH_ENV, "/x/k.so")
    assert accept_snapshot.kernel_path() == "/x/k.so"


def test_a_missing_file_means_clones_kernel_not_built(tmp_path):
    path = str(tmp_path / "dsv41_accept_snapshot.so")
    assert accept_snapshot._probe(path, (9, 0)) == (("clones", f"kernel not built ({path} missing)"), None)
    assert accept_snapshot._probe(path, None) == (("clones", "no CUDA"), None)


def test_a_corrupt_file_means_clones_load_error(tmp_path):
    path = tmp_path / "dsv41_accept_snapshot.so"
    path.write_bytes(b"\x7fELF not really" * 64)
    (mode, reason), kernel = accept_snapshot._probe(str(path), (9, 0))
    assert (mode, kernel) == ("clones", None)
    assert reason.startswith(f"load error: {path}: ImportError: "), reason


@pytest.mark.parametrize(
    "capability, archs, runs",
    [
        ((9, 0), "9.0 10.0", True),
        ((10, 0), "9.0 10.0", True),
        ((10, 3), "9.0 10.0", True),  # sm_100 machine code runs on 10.3
        ((8, 0), "9.0 10.0", False),
        ((12, 0), "9.0 10.0", False),  # another major: no machine code, no PTX
        ((12, 0), "9.0 10.0+PTX", True),  # the driver compiles the PTX
        ((9, 0), "9.0a", True),
        ((9, 1), "9.0a", False),  # arch-specific code runs on that one arch only
        ((8, 6), "8.0", True),
    ],
)
def test_which_gpus_a_build_serves(capability, archs, runs):
    assert accept_snapshot.runs_on(capability, archs) is runs


@pytest.mark.parametrize("archs", ["", "sm_90", "9", "Hopper", "9.0,10.0"])
def test_an_arch_list_the_loader_could_not_check_is_refused(archs):
    with pytest.raises(ValueError, match="--archs"):
        accept_snapshot._arch_list(archs)


def test_the_build_command_fails_on_it_and_writes_nothing(tmp_path):
    """A build argument not understood is bad configuration (78), whatever --allow-clones says."""
    for allow in ("0", "1"):
        done = build_kernel("--archs", "sm_90", "--out", str(tmp_path / "k.so"), "--allow-clones", allow)
        assert done.returncode == 78 and "build-kernel: --archs 'sm_90': expected entries" in done.stderr, done.stderr
    assert list(tmp_path.iterdir()) == []


# --- the sources: files of the package, hashed byte for byte ---------------------------------

def test_the_sources_are_the_packages_files_and_every_byte_keys_the_build(tmp_path):
    assert sorted(p.name for p in accept_snapshot.KERNELS.iterdir()) == sorted(accept_snapshot.SOURCES)
    assert accept_snapshot.SOURCE_HASH == accept_snapshot.source_hash(accept_snapshot.KERNELS)
    copy = tmp_path / "kernels"
    shutil.copytree(accept_snapshot.KERNELS, copy)
    assert accept_snapshot.source_hash(copy) == accept_snapshot.SOURCE_HASH
    for name in accept_snapshot.SOURCES:
        original = (copy / name).read_bytes()
        (copy / name).write_bytes(original[:-1] + bytes([original[-1] ^ 1]))  # one bit of its last byte
        assert accept_snapshot.source_hash(copy) != accept_snapshot.SOURCE_HASH, name
        (copy / name).write_bytes(original)
    # A byte moved from one file to the other: the same bytes in all, other sources.
    cu, cpp = (copy / name for name in accept_snapshot.SOURCES)
    cu.write_bytes(cu.read_bytes() + cpp.read_bytes()[:1])
    cpp.write_bytes(cpp.read_bytes()[1:])
    assert accept_snapshot.source_hash(copy) != accept_snapshot.SOURCE_HASH


def test_the_old_module_command_fails_and_says_where_it_went():
    done = subprocess.run([sys.executable, "-P", "-m", "sglang_dsv41_adapters.folded_fence.accept_snapshot", "build"],
                          cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)}, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 1 and "run `sglang-adapters build-kernel`" in done.stderr, done.stderr


def said(stderr: str) -> list[str]:
    """build-kernel's own lines (torch warns on stderr too: no CUDA runtime on this machine)."""
    return [line for line in untimed(stderr) if line.startswith("build-kernel:")]


def test_no_compiler_is_one_line_naming_the_archs_the_step_and_the_option(tmp_path):
    """A machine without nvcc, as CI runs the image's kernel step: the first line is the verdict,
    the archs, the step, the cause and the fix; nothing is written."""
    out = tmp_path / "k.so"
    nowhere = {"CUDA_HOME": str(tmp_path / "no-cuda")}  # two short commands: fresh interpreters (build_kernel)
    done = build_kernel("--archs", "9.0 10.0", "--out", str(out), env=nowhere, warm=False)
    assert done.returncode == 1, done.stderr[-3000:]
    (line,) = said(done.stderr)
    assert line.startswith(f"build-kernel: NOT BUILT - archs 9.0 10.0, step find nvcc: no CUDA compiler "
                           f"(CUDA_HOME='{tmp_path / 'no-cuda'}', "), line
    assert line.endswith("; fix: correct the build, or pass --allow-clones 1 (the image's --build-arg "
                         "ALLOW_CLONE_FENCE=1) to ship a fence that uses clones (exit 1)"), line
    allowed = build_kernel("--archs", "9.0", "--out", str(out), "--allow-clones", "1", env=nowhere, warm=False)
    assert allowed.returncode == 0 and said(allowed.stderr)[0].startswith(
        "build-kernel: NOT BUILT, the fence will use clones (allowed by --allow-clones 1) - archs 9.0, step find nvcc: ")
    assert not out.exists()


def test_a_compile_error_names_the_source_file_and_line(tmp_path):
    """The compiler reads the package's own files: its message names the file and the line,
    and nothing is written."""
    home = cuda_home()
    if home is None:
        pytest.skip("no CUDA compiler here (set CUDA_HOME): the kernel file cannot be built")
    pack = tmp_path / "sglang_dsv41_adapters"
    shutil.copytree(ROOT / "adapter", pack, ignore=shutil.ignore_patterns("__pycache__"))
    device = pack / "folded_fence" / "kernels" / accept_snapshot.SOURCES[0]
    lines = device.read_text().splitlines(keepends=True)
    broken = next(i for i, line in enumerate(lines) if line.startswith("namespace {")) + 2
    lines.insert(broken - 1, "  not_a_type broken_here;\n")
    device.write_text("".join(lines))
    out = tmp_path / "opt" / "k.so"
    # One compile at a time (torch's MAX_JOBS): the broken file is the first built, and the build
    # stops there instead of finishing the host file beside it.
    done = build_kernel("--archs", "8.0", "--out", str(out), env={"MAX_JOBS": "1"}, root=tmp_path)
    assert done.returncode == 1, done.stdout + done.stderr[-4000:]
    first = said(done.stderr)[0]  # the compiler's one-line cause first, the step and the archs named
    assert first.startswith(f"build-kernel: NOT BUILT - archs 8.0, step compile: {device}({broken}): error: "), first
    assert first.endswith("--allow-clones 1 (the image's --build-arg ALLOW_CLONE_FENCE=1) to ship a fence that uses "
                          "clones (exit 1)"), first
    assert f"{device}({broken}): error: " in done.stderr and "not_a_type" in done.stderr, done.stderr[-4000:]
    assert not out.exists() and not list(out.parent.glob("*"))


# --- detach: the struct is rebuilt with keywords -------------------------------------------

class KwOnlyOuts(msgspec.Struct, kw_only=True):
    first: torch.Tensor
    second: torch.Tensor


def test_detach_rebuilds_a_keyword_only_struct():
    outs = KwOnlyOuts(first=torch.arange(4), second=torch.ones(2, 3, dtype=torch.int32))
    copy = accept_snapshot.detach(outs, ("first", "second"))
    assert type(copy) is KwOnlyOuts
    for name in ("first", "second"):
        mine, theirs = getattr(copy, name), getattr(outs, name)
        assert torch.equal(mine, theirs) and mine.untyped_storage().data_ptr() != theirs.untyped_storage().data_ptr()


# --- a real kernel file (needs nvcc, no GPU) ------------------------------------------------

def test_a_kernel_for_another_arch_means_clones(sm80):
    assert accept_snapshot._probe(str(sm80), (9, 0)) == (("clones", "arch sm_90 not in the build (8.0)"), None)


def test_a_kernel_for_this_arch_is_loaded_by_path(sm80):
    for capability in ((8, 0), (8, 6)):
        (mode, where), kernel = accept_snapshot._probe(str(sm80), capability)
        assert (mode, where) == ("one-launch", str(sm80)) and kernel.__file__ == str(sm80)
    info = accept_snapshot._info(kernel)
    assert info == {"archs": "8.0", "source": accept_snapshot.SOURCE_HASH, "torch": torch.__version__}
    # The binding takes a list of tensors; CPU tensors take its clone path.
    a, b = torch.arange(5), torch.ones(2, 2)
    got = kernel.snapshot([a, b])
    assert torch.equal(got[0], a) and torch.equal(got[1], b) and got[0].data_ptr() != a.data_ptr()


def test_a_kernel_from_other_sources_is_not_used(sm80, monkeypatch):
    monkeypatch.setattr(accept_snapshot, "SOURCE_HASH", "0" * 16)
    (mode, reason), kernel = accept_snapshot._probe(str(sm80), (8, 0))
    assert (mode, kernel) == ("clones", None)
    assert "built from other sources" in reason and reason.startswith(f"load error: {sm80}: "), reason


def test_the_kernel_file_loads_read_only_from_a_fresh_interpreter(sm80, tmp_path):
    """What a rank does: load the file by path, here from a read-only folder, writing nothing."""
    folder = tmp_path / "ro"
    folder.mkdir()
    kernel = folder / "k.so"
    kernel.write_bytes(sm80.read_bytes())
    kernel.chmod(0o444)
    folder.chmod(0o555)
    try:
        code = ("from sglang_dsv41_adapters.folded_fence import accept_snapshot as a; (mode, where), k = a._probe(a.kernel_path(), (8, 0));"
                "print(mode, where == k.__file__)")
        env = {**os.environ, "PYTHONPATH": str(ROOT), accept_snapshot.PATH_ENV: str(kernel),
               "PYTHONDONTWRITEBYTECODE": "1"}
        done = subprocess.run([sys.executable, "-P", "-c", code], cwd=tmp_path, env=env, capture_output=True,
                              text=True, timeout=120)
        assert (done.returncode, done.stdout.strip()) == (0, "one-launch True"), done.stderr
        assert sorted(p.name for p in folder.iterdir()) == ["k.so"]
    finally:
        folder.chmod(0o755)


class _CudaLike:
    """Stands for a CUDA tensor where none exists: only what detach reads of it."""

    is_cuda = True

    def __init__(self, value):
        self.value = value

    def clone(self):
        return _CudaLike(self.value)


def test_the_first_cuda_result_says_which_copy_serves(monkeypatch, capsys):
    """Probed once, at the first CUDA result (on the rank's own device), and said in one line."""
    monkeypatch.setattr(accept_snapshot, "_mode", None)
    monkeypatch.setattr(accept_snapshot, "_capability", lambda: None)  # this machine: no GPU
    outs = KwOnlyOuts(first=_CudaLike(1), second=_CudaLike(2))
    for _ in range(3):
        copy = accept_snapshot.detach(outs, ("first", "second"))
        assert copy.first is not outs.first and copy.first.value == 1
    lines = untimed(capsys.readouterr().err)
    assert lines == [f"[sglang-adapters] pid={os.getpid()} rank=launcher folded_fence copy: clones - no CUDA"]


# --- told before any CUDA work: doctor and each rank's APPLIED line -------------------------

def test_the_expected_copy_is_told_from_nvml_without_cuda(monkeypatch, tmp_path):
    """What doctor and the APPLIED line say: the GPUs' capability from NVML (here stood in),
    the kernel file loaded but not run, every GPU served or it says clones and why."""
    monkeypatch.setenv(accept_snapshot.PATH_ENV, str(tmp_path / "none.so"))
    monkeypatch.setattr(accept_snapshot, "nvml_capabilities", lambda: [])
    assert accept_snapshot.expected_mode() == ("clones", "no CUDA")
    monkeypatch.setattr(accept_snapshot, "nvml_capabilities", lambda: [(9, 0), (9, 0)])
    assert accept_snapshot.expected_mode() == ("clones", f"kernel not built ({tmp_path / 'none.so'} missing)")


def test_the_expected_copy_for_a_kernel_of_another_arch(sm80, monkeypatch):
    monkeypatch.setenv(accept_snapshot.PATH_ENV, str(sm80))
    monkeypatch.setattr(accept_snapshot, "nvml_capabilities", lambda: [(8, 0)])
    assert accept_snapshot.expected_mode() == ("one-launch", str(sm80))
    monkeypatch.setattr(accept_snapshot, "nvml_capabilities", lambda: [(8, 0), (9, 0)])
    assert accept_snapshot.expected_mode() == ("clones", "on some GPUs: arch sm_90 not in the build (8.0)")


def test_the_applied_line_and_doctor_say_which_copy(monkeypatch):
    from sglang_dsv41_adapters import cli
    from sglang_dsv41_adapters import folded_fence
    from sglang_dsv41_adapters.framework import runtime
    from sglang_dsv41_adapters.engine.installed import InstalledEngine

    monkeypatch.setattr(accept_snapshot, "nvml_capabilities", lambda: [])  # this machine: no GPU
    environ = {folded_fence.FLAG: "1"}
    decision = runtime.decide(environ, names=(folded_fence.NAME,))
    [line] = decision.lines()
    assert "APPLIED - copy: clones (no CUDA); fenced TargetVerifyExecutor." in line  # the copy first: never cut
    assert len(line) < 200
    assert '"machine":"copy: clones (no CUDA)"' in decision.lines("json")[0]
    row = next(r for r in cli.report(environ, InstalledEngine())["adapters"] if r["adapter"] == folded_fence.NAME)
    assert row["machine"] == "copy: clones (no CUDA)"
    assert runtime.decide({}, names=(folded_fence.NAME,)).lines()[0].endswith("OFF - DSV41_FOLDED_FENCE is off (sglang 0.5.23)")


# --- the broadcast's block and the divergence report's comparison (one launch each) ----------

def test_the_library_packs_and_compares_cuda_values_only(sm80):
    """Its pack and count_divergence are bound; on CPU values they decline, launching nothing,
    so the callers' own paths serve (tests/test_eager_paths.py: what the callers do then)."""
    kernel = accept_snapshot._probe(str(sm80), (8, 0))[1]
    fields = [torch.arange(4, dtype=torch.int32), torch.arange(4, dtype=torch.int64)]
    assert kernel.pack(fields) == [] and kernel.pack(()) == []
    counts = torch.zeros(32, 3, dtype=torch.int64)
    assert kernel.count_divergence(fields, fields, counts, 10, False) is False
    assert not counts.any()
