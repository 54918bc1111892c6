"""A detached copy of DSpark's accept results, made cheaply and safely.

The folded accept leaves six small tensors (`AcceptOuts`) in the verify graph's
persistent buffers. The fence needs a copy of them that no later replay touches,
queued on the forward stream right where they escape. Six `clone()` calls do it (six
allocations, six kernel launches: about +55-75 us host time per verify step on an
H200), and that is what this module does on the CPU and whenever the fast path is
not available.

The fast path, for CUDA tensors, is one call into a small compiled kernel library
that takes ONE block from PyTorch's caching allocator, fills it with ONE kernel
launch on the current stream, and returns six typed tensors that share that block.
The copy is fresh memory, so it is correct by construction for every consumer:
Python references keep the block alive, and the scheduler's readback (`record_stream`
on its copy stream) keeps the allocator from reusing the block until the copy ran,
exactly as for a clone. No preallocated slot is ever rewritten.

Nothing is compiled at run time. The image build compiles the library once
(`sglang-adapters build-kernel --archs "9.0 10.0"`: torch's `load` of the sources in
kernels/ into a temporary folder, checked by loading it in a fresh interpreter,
then moved to its path); each process loads that file by path with Python's own
extension loader, the first time it is needed: no JIT cache, no lock, nothing
written, any user, read-only file systems. The path is $DSV41_ADAPTERS_SNAPSHOT_KERNEL,
else DEFAULT_PATH. If the file is missing, does not load, was built from other
sources or another torch, or holds no code for this GPU, the clones serve and
`copy_mode()` says why: the values are the same either way, only the cost differs.

The same library serves two more callers on the eager decode path (one launch where torch costs
several in host time), offered to them
through spectpsync.library: `pack` (snapshot's block, plus the block itself as one flat tensor,
for the rank-0 broadcast's one collective), `count_divergence` and `count_pair` (the divergence
report's fused comparison, one launch per site call), `receive` (the tensor a rank receives
rank 0's value into at a report site: one kept block per stream) and `report_sync` (the
report's wrapper of SpecTpSync.sync, its common eager call in C).
"""

from __future__ import annotations

import argparse
import hashlib
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Optional

from . import holders
from ..engine import settings
from ..framework import log, metrics, progress
from ..spectpsync import library as shared_library

__all__ = ["copy_mode", "expected_mode", "snapshot", "detach", "kernel_path", "extension", "use_extension", "build"]

PATH_ENV = settings.SNAPSHOT_KERNEL
MODULE = "dsv41_accept_snapshot"              # the library's Python module name (PyInit_<MODULE>)
DEFAULT_PATH = f"/opt/sglang-dsv41/{MODULE}.so"
DEFAULT_ARCHS = "9.0 10.0"                    # Hopper and Blackwell data-centre parts

# The library's sources, files of the package (its data): the CUDA side and the host side (the
# Python module and the C forms of the pack's Python checks). The build compiles them where they
# lie, so a compiler's message names the file and line.
KERNELS = Path(__file__).resolve().parent / "kernels"
SOURCES = ("accept_snapshot.cu", "accept_snapshot_host.cpp")


def source_hash(folder: Path = KERNELS) -> str:
    """Which sources a kernel file is built from: every byte of each, and its name."""
    digest = hashlib.sha256()
    for name in SOURCES:
        data = (folder / name).read_bytes()
        digest.update(f"{name}\0{len(data)}\0".encode())
        digest.update(data)
    return digest.hexdigest()[:16]


# A file built from other sources (another pack version, a changed byte) is not used.
SOURCE_HASH = source_hash()
_ARCH = re.compile(r"(\d+)\.(\d+)([af]?)(\+PTX)?")

_mode: Optional[tuple] = None  # copy_mode()'s answer once probed
_kernel = None                 # the loaded library, when it can serve this GPU
_enabled = True                # use_extension() (tests, benchmarks)
_snapshot = None               # _kernel.snapshot while enabled: the hot path's one check
_checks = None                 # the library whose views_check is `current` (use_checks)


def kernel_path() -> str:
    return settings.get(PATH_ENV) or DEFAULT_PATH


def snapshot(tensors):
    """Fresh copies of `tensors`, queued on the current stream: one launch into one new
    block on CUDA when the kernel file serves this GPU, else clones."""
    if tensors[0].is_cuda:
        if _mode is None:
            _report(copy_mode())
        if _snapshot is not None:
            return _snapshot(tensors)
    return [t.clone() for t in tensors]


def views_current(cached, live, was) -> bool:
    """The cheap form's per-call test of its cached views (fence_forms): each buffer the
    epilogue holds now (`live`) is the very object its views were cut from (`cached`), over
    the memory it had then (`was`: an alias taken when they were cut): the same storage,
    offset, sizes, strides, dtype and neg/conj bits. A buffer re-pointed in place (set_,
    .data =, a resize_) is the same object over other memory. The kernel library's
    views_check() answers the same in C (it compares storage addresses where this compares
    storages: never more lenient); `current` is whichever serves."""
    return len(cached) == len(live) == len(was) and all(map(_same_memory, cached, live, was))


def _same_memory(cached, buffer, was) -> bool:
    try:
        return (buffer is cached and buffer.is_set_to(was) and buffer.dtype == was.dtype
                and buffer.is_neg() == was.is_neg() and buffer.is_conj() == was.is_conj())
    except Exception:  # noqa: BLE001 - no storage to compare (sparse, nested): not the same memory
        return False


current = views_current  # the cheap form's test: the kernel library's C form once it is loaded


def use_checks(library) -> None:
    """Test the cheap form's views with `library`'s C form (a loaded kernel library; tests and
    benchmarks on the CPU, where no GPU loads one), or in Python (None)."""
    global current, _checks
    current = views_current if library is None else library.views_check()
    _checks = library


def checks_library():
    """The kernel library whose C form tests the views now, or None (fence_forms: its trusted call
    is then bound in C as well)."""
    return _checks


def detach(outs, fields):
    """A copy of `outs` whose `fields` (keys as holders.items names them) own their memory,
    snapshotted together on the current stream; every other field carried over and the
    copy of `outs`'s own type (holders.replaced: a subclass keeps its extra fields, a
    tuple, a keyword-only or frozen struct is no obstacle)."""
    if not fields:
        return outs
    values = dict(holders.items(outs))
    return holders.replaced(outs, dict(zip(fields, snapshot([values[key] for key in fields]))))


def _report(mode: tuple[str, str]) -> None:
    # Probed at the first CUDA result, on the rank's own device (a probe at start-up would
    # open a CUDA context on device 0 in every rank): one line says which copy serves.
    log.emit(f"folded_fence copy: {mode[0]} - {mode[1]}", adapter="folded_fence", copy=mode[0], detail=mode[1])
    metrics.copy_mode(mode[0])


def copy_mode() -> tuple[str, str]:
    """("one-launch", the kernel file it loaded) or ("clones", why). The first call
    loads the file (a dlopen, no compile, no GPU work beyond a capability query)."""
    global _mode, _kernel
    if _mode is None:
        _mode, _kernel = _probe(kernel_path(), _capability())
        use_extension(_enabled)
        if _kernel is not None:
            use_checks(_kernel)
    if _kernel is not None and not _enabled:
        return ("clones", "switched off by use_extension(False)")
    return _mode


def expected_mode() -> tuple[str, str]:
    """What copy_mode() will answer in a rank, told without touching CUDA (doctor, the
    per-rank line at start-up): the GPUs' compute capability from NVML, the kernel file
    loaded but not run. Every GPU of the machine must be served for "one-launch"."""
    capabilities = nvml_capabilities()
    if not capabilities:
        return _probe(kernel_path(), None)[0]
    modes = {_probe(kernel_path(), capability)[0] for capability in sorted(set(capabilities))}
    return modes.pop() if len(modes) == 1 else ("clones", "on some GPUs: " + "; ".join(sorted(m[1] for m in modes if m[0] == "clones")))


def nvml_capabilities() -> list:
    """(major, minor) of every GPU NVML sees, [] without a driver. NVML opens no CUDA
    context (torch.cuda would, on device 0, in whichever process asks)."""
    import ctypes

    try:
        nvml = ctypes.CDLL("libnvidia-ml.so.1")
    except OSError:
        return []
    count, found = ctypes.c_uint(), []
    if nvml.nvmlInit_v2() != 0:
        return []
    try:
        if nvml.nvmlDeviceGetCount_v2(ctypes.byref(count)) != 0:
            return []
        for index in range(count.value):
            handle, major, minor = ctypes.c_void_p(), ctypes.c_int(), ctypes.c_int()
            if (nvml.nvmlDeviceGetHandleByIndex_v2(index, ctypes.byref(handle)) == 0
                    and nvml.nvmlDeviceGetCudaComputeCapability(handle, ctypes.byref(major), ctypes.byref(minor)) == 0):
                found.append((major.value, minor.value))
    finally:
        nvml.nvmlShutdown()
    return found


def extension():
    """The loaded kernel library (for benchmarks: `empty_launch` is the yardstick), or None."""
    copy_mode()
    return _kernel


def probed_extension():
    """The loaded kernel library, or None, probed as at the fence's first CUDA result and
    said in the same one line (fence_boundary's native scan, at its first check on a GPU)."""
    if _mode is None:
        _report(copy_mode())
    return _kernel


def _offered():
    """(the library or None, its file or why not), for the shared decode-path code."""
    kernel = extension()
    return kernel, (kernel_path() if kernel is not None else copy_mode()[1])


shared_library.offer(_offered)  # the broadcast's block and the divergence report's comparison: one launch each


def use_extension(enabled: bool) -> None:
    """Switch the fast path on or off (tests and benchmarks compare both); off means clones."""
    global _enabled, _snapshot
    _enabled = bool(enabled)
    _snapshot = _kernel.snapshot if (_kernel is not None and _enabled) else None


def _capability() -> Optional[tuple]:
    import torch

    return torch.cuda.get_device_capability() if torch.cuda.is_available() else None


def runs_on(capability: tuple, archs: str) -> bool:
    """Whether code built for `archs` (TORCH_CUDA_ARCH_LIST entries) runs on a GPU of
    `capability`: machine code for X.Y runs on X.Z with Z >= Y (X.Ya on X.Y only),
    +PTX on any later GPU (the driver compiles it)."""
    for arch in archs.split():
        m = _ARCH.fullmatch(arch)
        if not m:
            continue
        built = (int(m[1]), int(m[2]))
        if m[4] and m[3] != "a" and tuple(capability) >= built:
            return True
        if capability[0] == built[0] and (capability[1] == built[1] if m[3] == "a" else capability[1] >= built[1]):
            return True
    return False


def _info(kernel) -> dict:
    return dict(part.partition("=")[::2] for part in kernel.build_info().split(";"))


def imported(path: str):
    """The kernel file at `path` as a module, by Python's extension loader, unchecked."""
    import importlib.machinery
    import importlib.util

    import torch  # noqa: F401 - the library links against the libraries torch has loaded

    loader = importlib.machinery.ExtensionFileLoader(MODULE, path)
    spec = importlib.util.spec_from_file_location(MODULE, path, loader=loader)
    kernel = importlib.util.module_from_spec(spec)
    loader.exec_module(kernel)
    return kernel


def load(path: str):
    """Load the kernel file with Python's extension loader, by path; check that it was
    built from these sources against this torch. Returns (module, its arch list)."""
    import torch

    kernel = imported(path)
    info = _info(kernel)
    if info.get("source") != SOURCE_HASH:
        raise ImportError(f"built from other sources ({info.get('source')}; this pack's: {SOURCE_HASH})")
    if info.get("torch") != torch.__version__:
        raise ImportError(f"built against torch {info.get('torch')}, this is torch {torch.__version__}")
    return kernel, info.get("archs", "")


def _probe(path: str, capability: Optional[tuple]):
    """((mode, detail), loaded library or None) for a GPU of `capability` (None: no CUDA)."""
    if capability is None:
        return ("clones", "no CUDA"), None
    if not os.path.isfile(path):
        return ("clones", f"kernel not built ({path} missing)"), None
    try:
        kernel, archs = load(path)
    except Exception as exc:  # noqa: BLE001 - any failure leaves the clones in place
        return ("clones", f"load error: {path}: {type(exc).__name__}: {str(exc).strip()[-300:]}"), None
    if not runs_on(capability, archs):
        return ("clones", f"arch sm_{capability[0]}{capability[1]} not in the build ({archs})"), None
    return ("one-launch", path), kernel


# --- the build (image build time; needs nvcc, no GPU) -------------------------------------

def _arch_list(archs: str) -> str:
    items = archs.replace(";", " ").split()
    bad = [a for a in items if not _ARCH.fullmatch(a)]
    if not items or bad:
        raise ValueError(f"--archs {archs!r}: expected entries like 9.0, 10.0, 9.0a, 9.0+PTX")
    return " ".join(items)


class BuildError(RuntimeError):
    """A build step that failed: `step`, its one-line `cause`, and the tool's whole output."""

    def __init__(self, step: str, cause: str, output: str = ""):
        self.step, self.cause, self.output = step, cause, output
        super().__init__(f"{step}: {cause}")


def first_cause(output: str) -> str:
    """The compiler's one-line cause in its output: its first error line, else the last line."""
    lines = [line.strip() for line in output.splitlines() if line.strip()]
    for line in lines:
        if re.search(r"\berror\b", line, re.IGNORECASE) and not line.startswith(
                ("[", "ninja: build stopped", "Error building extension")):
            return line
    return lines[-1] if lines else "no output"


def build(out: str, archs: str = DEFAULT_ARCHS, verbose: bool = False) -> str:
    """Compile the kernel library for `archs`, check it loads in a fresh interpreter,
    and move it to `out`. Raises BuildError on any failure; `out` is only written on success."""
    archs = _arch_list(archs)
    with progress.step(f"build-kernel: importing torch to find the compiler (archs {archs})"):
        import torch
        from torch.utils import cpp_extension

    nvcc = os.path.join(cpp_extension.CUDA_HOME or "", "bin", "nvcc")
    if not cpp_extension.CUDA_HOME or not os.access(nvcc, os.X_OK):
        raise BuildError("find nvcc", f"no CUDA compiler (CUDA_HOME={cpp_extension.CUDA_HOME!r}, no {nvcc})")
    if torch.version.cuda is None:
        raise BuildError("find nvcc", f"torch {torch.__version__} is built without CUDA")
    os.environ["TORCH_CUDA_ARCH_LIST"] = archs  # torch's way to name the targets
    out = os.path.abspath(out)
    os.makedirs(os.path.dirname(out), exist_ok=True)
    staged = f"{out}.{os.getpid()}.tmp"  # beside `out`: os.replace does not cross file systems
    try:
        with tempfile.TemporaryDirectory(prefix="accept-snapshot-") as tmp:
            # The one source the build writes: what the loader checks the file by.
            stamp = os.path.join(tmp, "build_info.cpp")
            with open(stamp, "w") as file:
                file.write("#include <string>\nstd::string build_info() { return "
                           f'"archs={archs};source={SOURCE_HASH};torch={torch.__version__}"; }}\n')
            step = f"compile {', '.join(SOURCES)} for archs {archs}"
            try:
                with progress.step(f"build-kernel: {step} with nvcc (about 100 s)"):
                    cpp_extension.load(
                        name=MODULE, sources=[str(KERNELS / name) for name in SOURCES] + [stamp], extra_cflags=["-O2"],
                        extra_cuda_cflags=["-O2"], build_directory=tmp, verbose=verbose,
                    )
            except Exception as exc:  # noqa: BLE001 - torch raises RuntimeError with the compiler's whole output
                raise BuildError("compile", first_cause(str(exc)), str(exc)) from exc
            shutil.copyfile(os.path.join(tmp, f"{MODULE}.so"), staged)
        # Loaded as a rank will load it: a fresh interpreter, by path, no build folder.
        with progress.step("build-kernel: loading the built file in a fresh interpreter, as a rank will"):
            check = subprocess.run(
                [sys.executable, "-P", "-c", f"from sglang_dsv41_adapters.folded_fence.accept_snapshot import load; print(load({staged!r})[1])"],
                capture_output=True, text=True, timeout=300, env={**os.environ, "PYTHONPATH": _pack_root()},
            )
        if check.returncode != 0 or check.stdout.strip() != archs:
            output = (check.stdout + check.stderr).strip()
            raise BuildError("load check", f"the built kernel does not load: {first_cause(output)}", output)
        os.chmod(staged, 0o644)
        os.replace(staged, out)
    finally:
        if os.path.exists(staged):
            os.remove(staged)
    return out


def _pack_root() -> str:
    """The folder that holds this pack (sglang_dsv41_adapters/), first on the check's path."""
    here = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    return os.pathsep.join([here, os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep)


def build_command(argv: list[str]) -> int:
    """compile the fence's kernel library (image build time; needs nvcc, no GPU)"""
    parser = argparse.ArgumentParser(
        prog="sglang-adapters build-kernel",
        description=f"Compile the fence's kernel library ({', '.join(SOURCES)} in {KERNELS}) for --archs, check "
                    "that it loads in a fresh interpreter, then move it to --out, where every rank loads it by path.",
        epilog=f"exit statuses: {os.EX_OK} built (or not, allowed by --allow-clones 1); 1 the kernel did not build "
               f"or load (the compiler's messages name its source files); {os.EX_USAGE} an unknown option; "
               f"{os.EX_CONFIG} --archs or --allow-clones not understood")
    parser.add_argument("--archs", default=DEFAULT_ARCHS, help=f"TORCH_CUDA_ARCH_LIST entries (default {DEFAULT_ARCHS!r})")
    parser.add_argument("--out", default=None, help=f"where to put it (default ${PATH_ENV}, else {DEFAULT_PATH})")
    parser.add_argument("--allow-clones", default="0",
                        help="1: a failed build is not an error, the fence will use clones; 0 (default): it fails")
    parser.add_argument("--verbose", action="store_true", help="show the compiler's command lines as they run")
    try:
        args = parser.parse_args(argv)
    except SystemExit as done:  # argparse's own: --help (0), a usage error (2, as the pack's 64)
        return os.EX_USAGE if done.code else os.EX_OK
    # The build's configuration is checked before anything is compiled, and no --allow-clones excuses it.
    try:
        archs = _arch_list(args.archs)
        if args.allow_clones not in ("0", "1"):
            raise ValueError(f"--allow-clones (ALLOW_CLONE_FENCE) must be 0 or 1, not {args.allow_clones!r}")
    except ValueError as exc:
        print(f"build-kernel: {exc} (exit {os.EX_CONFIG})", file=sys.stderr)
        return os.EX_CONFIG
    try:
        print(f"build-kernel: built {build(args.out or kernel_path(), archs, args.verbose)} for {archs}")
        return os.EX_OK
    except BuildError as exc:  # the one-line cause first, then the tool's whole output for the details
        failed = exc
    except Exception as exc:  # noqa: BLE001 - any other failure is a step's too
        failed = BuildError("build", f"{type(exc).__name__}: {str(exc).strip().splitlines()[0] if str(exc).strip() else ''}")
    where = f"archs {archs}, step {failed.step}: {failed.cause}"
    if args.allow_clones == "1":
        print(f"build-kernel: NOT BUILT, the fence will use clones (allowed by --allow-clones 1) - {where}",
              file=sys.stderr)
    else:
        print(f"build-kernel: NOT BUILT - {where}; fix: correct the build, or pass --allow-clones 1 (the image's "
              "--build-arg ALLOW_CLONE_FENCE=1) to ship a fence that uses clones (exit 1)", file=sys.stderr)
    if failed.output:
        print(f"build-kernel: the {failed.step} step's whole output follows\n{failed.output}", file=sys.stderr)
    return os.EX_OK if args.allow_clones == "1" else 1


if __name__ == "__main__":  # the command this module was before; silence would ship an image without the kernel
    sys.exit("sglang_dsv41_adapters.folded_fence.accept_snapshot is no command: run `sglang-adapters build-kernel`")
