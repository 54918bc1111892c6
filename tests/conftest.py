"""Shared fixtures: real sglang 0.5.23 DSpark objects built on the CPU."""

from __future__ import annotations

import contextlib
import fcntl
import gc
import json
import os
import shutil
import subprocess
import sys
import types
from pathlib import Path

from harness._zygote import COLLECTION

gc.set_threshold(*COLLECTION)  # from here, as in the warm parents: collecting imports torch and the engine

import pytest  # noqa: E402
import torch  # noqa: E402

from sglang_dsv41_adapters.folded_fence import fence_forms
from sglang_dsv41_adapters import folded_fence
from sglang_dsv41_adapters.framework import log, runtime
from harness import zygote
from harness.doctored import doctored_module  # noqa: F401  (used by the test modules)
from tests import deployment_image

ROOT = Path(__file__).resolve().parent.parent

VERIFY = folded_fence.VERIFY


class Step:
    """The values one verify step leaves in the epilogue buffers, distinct per step."""

    def __init__(self, step: int, bs: int, stride: int):
        base = 1000 * step
        self.values = {
            "correct_len": torch.arange(bs, dtype=torch.int64) + base + 1,
            "bonus": torch.arange(bs, dtype=torch.int64) + base + 2,
            "cap_trim_lens": torch.arange(bs, dtype=torch.int32) + base + 3,
            "commit_lens": torch.arange(bs, dtype=torch.int32) + base + 4,
            "new_seq_lens": torch.arange(bs, dtype=torch.int64) + base + 5,
            "out_tokens": torch.arange(bs * stride, dtype=torch.int64).view(bs, stride) + base + 6,
        }

    def write(self, epilogue) -> None:
        """Write the step into the persistent buffers, as a verify graph replay does."""
        for name, value in self.values.items():
            getattr(epilogue, f"{name}_buf")[: value.shape[0]].copy_(value)

    def matches(self, outs) -> dict[str, bool]:
        return {name: torch.equal(getattr(outs, name), value) for name, value in self.values.items()}


@pytest.fixture(scope="session", autouse=True)
def _proof_cache(tmp_path_factory):
    """The run's own proof cache (engine.proofs), empty at its start: never the user's. One for
    all the run's test processes (pytest-xdist's workers share the folder above their own), as
    the ranks of a pod share the image's: what one proves the others find, entries being
    written whole and renamed into place."""
    from sglang_dsv41_adapters.engine import proofs

    before = os.environ.get(proofs.ENV)
    if os.environ.get("PYTEST_XDIST_WORKER"):
        folder = tmp_path_factory.getbasetemp().parent / "proofs"  # the run's: its workers' folders are beside it
        folder.mkdir(exist_ok=True)
    else:
        folder = tmp_path_factory.mktemp("proofs")
    os.environ[proofs.ENV] = str(folder)
    yield
    if before is None:
        os.environ.pop(proofs.ENV, None)
    else:
        os.environ[proofs.ENV] = before


@pytest.fixture(scope="session", autouse=True)
def _cuda_home():
    """The run's processes name the CUDA compiler the kernel tests use (CUDA_HOME), where the
    environment does not: torch reads it once, when torch.utils.cpp_extension is imported, and the
    warm parents import it (harness.zygote), so a build that named it alone had parents of its own."""
    home = cuda_home()
    if home is None or "CUDA_HOME" in os.environ:
        yield
        return
    os.environ["CUDA_HOME"] = home
    yield
    os.environ.pop("CUDA_HOME", None)


@pytest.fixture(scope="session", autouse=True)
def _tree_children_start_warm():
    """The interpreter that runs a tree's SpecTpSync (spectpsync.behaviour) starts from a parent that has
    imported torch (harness.zygote.popen_once): the same child, without the seconds of its imports."""
    from harness import zygote
    from sglang_dsv41_adapters.spectpsync import behaviour

    before, behaviour.popen = behaviour.popen, zygote.popen_once
    yield
    behaviour.popen = before


@pytest.hookimpl(tryfirst=True)
def pytest_unconfigure(config):
    """The pack's syntax trees dropped before pytest's own last collections (its unraisable-exception
    plugin collects twice as a test process ends): those the last file read are not frozen yet
    (_kept_out_of_collections), and each collection would otherwise walk them; the frozen ones are
    freed with them, none cyclic."""
    from sglang_dsv41_adapters.engine import flow, proofs, syntax

    for cache in (flow._PARSED, flow._NAMES):
        cache.clear()
    for cached in (flow._marks, flow._self_stores, syntax.parse, syntax.index):
        cached.cache_clear()
    proofs.forget()


@pytest.fixture(scope="module", autouse=True)
def _kept_out_of_collections():
    """Before each file, what is there already is collected once, then frozen, as harness/_zygote.py
    freezes the engine: first what collecting the tests imported (torch and the engine: about 700,000
    objects), then what each file left (the engines' syntax trees the pack keeps, the warm parents'
    handles: three million objects and more by the end of a run). A collection a test sets off
    (gc.collect() to free an epilogue) walks what its file made, not the whole run's (about 3 s each),
    and collections come as seldom as in the zygote's children (harness._zygote.COLLECTION, set when
    this file is imported). Left frozen at the end: pytest's last collections and the interpreter's
    walk only what the last file made."""
    gc.collect()  # walks only what the file before made: the rest is frozen already
    gc.freeze()
    yield


@pytest.fixture(autouse=True)
def _launcher_label():
    """A test that labels this process a rank leaves it the launcher for the next one."""
    yield
    log.reset()


@pytest.fixture
def verify():
    import sglang.srt.speculative.dspark_components.dspark_verify as module

    yield module
    runtime.revert()
    fence_forms.cheap_form.cache_clear()  # a test's fallback is not the next test's


@pytest.fixture
def dspark(verify):
    return build_dspark(verify)


def build_dspark(verify, max_bs: int = 16, stride: int = 4, device="cpu"):
    """A real DsparkVerifyEpilogue and TargetVerifyExecutor of `verify` (sglang 0.5.23's
    dspark_verify, or a doctored copy of it), its buffers on `device` (the CPU by default).

    The TP group is an attribute holder for a single rank: SpecTpSync only reads
    world_size and rank_in_group from it at TP=1. The target worker is reduced to the
    one config field the executor reads (the model type)."""
    from sglang.srt.speculative.spec_tp_sync import SpecTpSync

    tp_sync = SpecTpSync(types.SimpleNamespace(world_size=1, rank_in_group=0))
    epilogue = verify.DsparkVerifyEpilogue(max_bs=max_bs, verify_num_draft_tokens=stride, device=device, tp_sync=tp_sync)
    config = types.SimpleNamespace(hf_text_config=types.SimpleNamespace(model_type="llama"))
    runner = types.SimpleNamespace(model_config=config)
    executor = verify.TargetVerifyExecutor(
        target_worker=types.SimpleNamespace(model_runner=runner), gamma=stride - 1, verify_num_draft_tokens=stride,
        model_runner=runner, kv_injector=None, tp_sync=tp_sync, verify_epilogue=epilogue,
    )
    return types.SimpleNamespace(module=verify, epilogue=epilogue, executor=executor, stride=stride, tp_sync=tp_sync)


def accept_kwargs(verify, *, bs: int, stride: int, folded: bool, seed: int = 0) -> dict:
    """Keyword arguments of one accept_and_finalize call, as the DSpark worker passes them."""
    from sglang.srt.speculative.dspark_components.dspark_draft import DraftBlockResult

    gen = torch.Generator().manual_seed(seed)
    vocab = 17
    candidates = torch.randint(0, vocab, (bs, stride), generator=gen)
    draft_block = DraftBlockResult(
        draft_tokens=candidates[:, 1:].contiguous(), corrected_logits=None,
        greedy_mask=torch.ones(bs, dtype=torch.bool), temperatures=torch.zeros(bs), greedy_draft=True,
    )
    return dict(
        folded_accept=folded, bs=bs, verify_ids_2d=candidates,
        target_logits=torch.randn(bs * stride, vocab, generator=gen), draft_block=draft_block,
        sampling_info=None, draft_input=None, layout=None,
        prefix_lens=torch.arange(bs, dtype=torch.int64) + 10, draft_tokens=candidates[:, 1:].contiguous(),
    )


# --- the fence's kernel file, built for sm_80 (needs nvcc, no GPU) ---------------------------

def cuda_home() -> str | None:
    home = os.environ.get("CUDA_HOME") or "/usr/local/cuda"
    return home if os.access(os.path.join(home, "bin", "nvcc"), os.X_OK) else None


def build_kernel(*args: str, env: dict | None = None, root: Path = ROOT, warm: bool = True) -> subprocess.CompletedProcess:
    """`sglang-adapters build-kernel ARGS`, the Dockerfile's kernel step, from the checkout at `root`
    (the pack there first on the path, as installed in the image). `warm`: a child of a parent that
    imported torch but not the engine (harness.zygote.popen_once), as the step imports; else a fresh
    interpreter (cheaper where no such parent has the environment: torch reads CUDA_HOME when imported)."""
    env = {**os.environ, "PYTHONPATH": str(root), **(env or {})}
    command = [sys.executable, "-P", str(ROOT / "entrypoint.py"), "build-kernel", *args]
    if not warm:
        return subprocess.run(command, cwd=root, env=env, capture_output=True, text=True, timeout=280)
    return zygote.run(command, cwd=root, env=env, capture_output=True, text=True, timeout=280, once=True)


@contextlib.contextmanager
def run_folder(tmp_path_factory, name: str):
    """A folder every xdist worker of this test run shares (a session's own without xdist),
    held under a lock: the first worker to need what it holds makes it, the others wait."""
    run = os.environ.get("PYTEST_XDIST_TESTRUNUID")  # the same in every worker of one run
    folder = (tmp_path_factory.getbasetemp().parent / f"{name}-{run}") if run else tmp_path_factory.mktemp(name)
    folder.mkdir(exist_ok=True)
    with open(folder / "lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield folder


@pytest.fixture(scope="session")
def image_venv(tmp_path_factory) -> Path:
    """The image's Python (tests/deployment_image.py: the pack's wheel beside the engine), made
    once per test run."""
    with run_folder(tmp_path_factory, "image") as folder:
        if not (folder / "made").is_file():
            shutil.rmtree(folder / "image", ignore_errors=True)  # what a failed try left
            deployment_image.make(folder / "image")
            (folder / "made").touch()
    return folder / "image" / "venv"


@pytest.fixture(scope="session")
def kernel_step(image_venv, tmp_path_factory) -> tuple[subprocess.CompletedProcess, Path]:
    """The Dockerfile's kernel step, run once per test run in the image's Python with a CUDA
    compiler, for sm_80 only (one architecture: the quickest build, ~45 s on 2 cores): what it
    printed, and the kernel file it wrote (/opt/sglang-dsv41 being a folder of the run's)."""
    home = cuda_home()
    if home is None:
        pytest.skip("no CUDA compiler here (set CUDA_HOME): the kernel file cannot be built")
    with run_folder(tmp_path_factory, "kernel-step") as folder:
        kernel, log = folder / "opt" / "dsv41_accept_snapshot.so", folder / "step.json"
        if not log.is_file():
            work = folder / "workdir"
            work.mkdir(exist_ok=True)
            done = deployment_image.run_kernel_step(deployment_image.Image(image_venv, work), kernel,
                                                    {"SNAPSHOT_KERNEL_ARCHS": "8.0"}, {"CUDA_HOME": home}, timeout=420)
            log.write_text(json.dumps([done.args, done.returncode, done.stdout, done.stderr]))
        return subprocess.CompletedProcess(*json.loads(log.read_text())), kernel


@pytest.fixture(scope="session")
def sm80(kernel_step) -> Path:
    """A real kernel file for sm_80: the image's kernel step's (conftest's kernel_step), shared by
    the kernel tests, the boundary scan's and test_image. The image's wheel carries the checkout's
    sources byte for byte (test_image), so the checkout's pack loads it."""
    done, kernel = kernel_step
    assert done.returncode == 0 and kernel.is_file(), done.stdout[-3000:] + done.stderr[-4000:]
    assert not list(kernel.parent.glob("*.tmp"))
    return kernel


@pytest.fixture
def clean_env(monkeypatch):
    """The engine's SpecTpSync selection at its default (SGLANG_SPEC_TP_SYNC unset); whatever
    the test applied through the runtime is reverted after it."""
    from sglang_dsv41_adapters.framework import runtime

    monkeypatch.delenv("SGLANG_SPEC_TP_SYNC", raising=False)
    yield
    runtime.revert()


@pytest.fixture
def servers():
    """servers(...) makes a stand-in sglang server on loopback (tests/standin_server.py: Server's arguments),
    closed after the test."""
    from tests.standin_server import Server

    made = []
    yield lambda *a, **k: made.append(Server(*a, **k)) or made[-1]
    for server in made:
        server.close()
