"""The deployment image (docker/Dockerfile) re-enacted without a Docker engine: the Dockerfile
and the recipe read as docker reads them, the image's Python made from the pack's wheel, and
the Dockerfile's kernel step run in it. Used by tests/test_image.py and by conftest (the image
and its kernel step are made once per test run).

The fresh environment. The engine (sglang 0.5.23 and its pins) lives in this repository's
.venv, which also holds the pack as an editable install. The test environment must see the
engine but not that editable pack, only the wheel, as the image does. So:
- `python -m venv --without-pip` from the .venv interpreter makes a venv on the same base
  Python (3.11) that sees nothing of .venv;
- a folder of symlinks to every entry of .venv's site-packages except the pack's own
  (its dist-info, the `__editable__` finder and .pth, `sglang_dsv41_adapters`) stands in for the
  image's system site-packages, and one line in a .pth file of the fresh venv puts that folder on
  sys.path, after the venv's own site-packages (a plain path line: .pth files inside the folder
  are not run, so the editable finder never loads);
- `pip --python <fresh venv>` installs the wheel (plus `wrapt==2.5.2`, already satisfied by the
  engine folder, as in the image) with --no-deps --no-index, which also creates the console
  script the ENTRYPOINT names.
This takes seconds and downloads nothing but the wheel's pinned build backend. The
alternatives do not fit: `--system-site-packages` would see the system Python, not .venv, and
installing the engine afresh would cost minutes and 6 GB.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

from harness import zygote

ROOT = Path(__file__).resolve().parent.parent
DOCKERFILE = ROOT / "docker" / "Dockerfile"
RECIPE = ROOT / "recipes" / "dsv41-flash-tp4-dspark"
ENV_FILE = RECIPE / "adapters.env"
SERVER_ARGS = RECIPE / "server.args"
PACK_DIST = "sglang_dsv41_adapters"
# What the Dockerfile's builder stage copies into the wheel's build context.
WHEEL_SOURCES = ("pyproject.toml", "README.md", "LICENSE", "adapter")


# --- reading the Dockerfile and the recipe, as docker does ---------------------------------

def dockerfile_instructions() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) per instruction, continuation lines joined, comments dropped."""
    lines = [l for l in DOCKERFILE.read_text().splitlines() if not l.lstrip().startswith("#")]
    joined = re.sub(r"\\\n", "", "\n".join(lines))
    out = []
    for line in joined.splitlines():
        if line.strip():
            instr, _, args = line.strip().partition(" ")
            out.append((instr.upper(), args.strip()))
    return out


def dockerfile_value(instr: str) -> list[str]:
    """The exec-form (JSON) arguments of the last INSTR, e.g. ENTRYPOINT."""
    found = [args for i, args in dockerfile_instructions() if i == instr]
    assert found, f"docker/Dockerfile has no {instr}"
    return json.loads(found[-1])


def dockerfile_args() -> dict[str, str]:
    return dict(a.split("=", 1) for i, a in dockerfile_instructions() if i == "ARG" and "=" in a)


def read_env_file(path: Path) -> dict[str, str]:
    """`docker run --env-file` semantics: KEY=VALUE taken literally, '#' lines and blanks skipped."""
    env = {}
    for line in path.read_text().splitlines():
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        key, sep, value = line.partition("=")
        assert sep, f"{path.name}: {line!r} is not KEY=VALUE (a bare KEY would pass the host's value)"
        env[key.lstrip()] = value
    return env


def read_server_args() -> list[str]:
    return [l.strip() for l in SERVER_ARGS.read_text().splitlines() if l.strip() and not l.lstrip().startswith("#")]


# --- the image's Python, re-enacted --------------------------------------------------------

class Image:
    def __init__(self, venv: Path, workdir: Path):
        self.venv, self.workdir = venv, workdir
        self.bin = venv / "bin"
        self.python = self.bin / "python"

    def env(self, extra: dict[str, str] | None = None) -> dict[str, str]:
        drop = ("PYTHONPATH", "PYTHONHOME", "PYTHONSTARTUP", "VIRTUAL_ENV", "SGLANG_PLUGINS", "SGLANG_PLATFORM")
        env = {k: v for k, v in os.environ.items() if k not in drop and not k.startswith("DSV41_")}
        env.update(PATH=f"{self.bin}{os.pathsep}{env.get('PATH', '')}", COLUMNS="120", HF_HUB_OFFLINE="1")
        # the container's own cache folder (the pack's proof cache defaults to one there), never this user's
        env.update(XDG_CACHE_HOME=str(self.workdir.parent / "cache"))
        env.update(extra or {})
        return env

    def command(self, argv: list[str]) -> list[str]:
        """An exec-form command line as the container would run it (PATH lookup in the image)."""
        exe = shutil.which(argv[0], path=str(self.bin))
        assert exe, f"{argv[0]} is not installed in the image's environment"
        return [exe, *argv[1:]]

    def popen(self, argv: list[str], env_extra: dict[str, str] | None = None) -> subprocess.Popen:
        """The command in the image's environment; a console script of the image's Python
        starts from a parent that imported the engine there (harness/zygote.py)."""
        return zygote.popen(self.command(argv), cwd=self.workdir, env=self.env(env_extra),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)

    def run(self, argv: list[str], env_extra: dict[str, str] | None = None, timeout: float = 150):
        proc = self.popen(argv, env_extra)
        out, err = proc.communicate(timeout=timeout)
        return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def _pip(*args: str, cwd: Path) -> str:
    done = subprocess.run([sys.executable, "-m", "pip", "--disable-pip-version-check", *args], cwd=cwd,
                          capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, f"pip {' '.join(args)} failed:\n{done.stdout}\n{done.stderr}"
    return done.stdout


def make(tmp: Path) -> Path:
    """The image's Python made in the empty folder `tmp`; its venv."""
    tmp.mkdir()
    # 1. The wheel, from a copy of exactly what the Dockerfile's builder stage copies, with the
    #    pinned build backend (isolated build), so the source tree gets no build/ folder.
    src = tmp / "src"
    src.mkdir()
    for name in WHEEL_SOURCES:
        path = ROOT / name
        if path.is_dir():
            shutil.copytree(path, src / name, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
        elif path.exists():
            shutil.copy2(path, src / name)
    wheels = tmp / "wheels"
    _pip("wheel", "--no-deps", str(src), "-w", str(wheels), cwd=tmp)
    (wheel,) = wheels.glob(f"{PACK_DIST}-*.whl")

    # 2. A fresh venv that sees the engine but not the editable pack (see this module's docstring).
    venv = tmp / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=60)
    engine_site = Path(sysconfig.get_paths()["purelib"])
    shadow = tmp / "engine-site-packages"
    shadow.mkdir()
    for entry in engine_site.iterdir():
        name = entry.name.lower().replace("-", "_")
        if (name.startswith((PACK_DIST, "__editable__", "sglang_dsv41_adapters"))
                or name.endswith(".pth") or name == "__pycache__"):
            continue
        (shadow / entry.name).symlink_to(entry)
    purelib = subprocess.run([str(venv / "bin" / "python"), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                             check=True, capture_output=True, text=True).stdout.strip()
    Path(purelib, "zz-engine.pth").write_text(f"{shadow}\n")

    # 3. The image's install line: the wheel and the pack's one runtime pin, --no-deps.
    out = _pip("--python", str(venv / "bin" / "python"), "install", "--no-deps", "--no-index", str(wheel), "wrapt==2.5.2",
               cwd=tmp)
    installed = re.findall(r"^Successfully installed (.*)$", out, re.M)
    assert installed and installed[-1].split() == [f"sglang-dsv41-adapters-{wheel.name.split('-')[1]}"], out
    return venv


# --- the fence's kernel build step, re-enacted --------------------------------------------
# The RUN that builds the snapshot kernel, run as docker runs it: the Dockerfile's SHELL, its
# ARGs (defaults, overridden like --build-arg) and ENVs in the environment, in the image's
# Python. CUDA_HOME pointing nowhere makes the build fail as on a base image without nvcc.
KERNEL_STEP = "sglang-adapters build-kernel"
# What Python's runpy prints when a package's module is run with -m after its package imported it.
RUNPY_WARNING = re.compile(r"RuntimeWarning|found in sys\.modules")


def dockerfile_env() -> dict[str, str]:
    return dict(a.split("=", 1) for i, a in dockerfile_instructions() if i == "ENV")


def kernel_build_step() -> str:
    (step,) = [a for i, a in dockerfile_instructions() if i == "RUN" and KERNEL_STEP in a]
    return step


def run_kernel_step(image: Image, kernel: Path, build_args: dict[str, str], env: dict[str, str], timeout: float = 200):
    """The step as the Dockerfile writes it, /opt/sglang-dsv41 being kernel's folder, which
    holds the recipe's adapters.env as the build's COPY puts it there."""
    opt = str(kernel.parent)
    kernel.parent.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(ENV_FILE, kernel.parent / "adapters.env")
    args = {k: v.strip('"').replace("/opt/sglang-dsv41", opt) for k, v in dockerfile_args().items()} | build_args
    environ = args | dockerfile_env() | {"DSV41_ADAPTERS_SNAPSHOT_KERNEL": str(kernel)} | env
    step = kernel_build_step().replace("/opt/sglang-dsv41", opt)
    done = subprocess.run(dockerfile_value("SHELL") + [step], cwd=image.workdir,
                          env=image.env(environ), capture_output=True, text=True, timeout=timeout)
    assert not RUNPY_WARNING.search(done.stderr), done.stderr  # the build log holds no warning of the pack's own
    return done
