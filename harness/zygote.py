"""Python child processes started from a warm parent that has already imported the engine.

Importing sglang takes 11 to 13 s on the two-core CI machine, and the suite starts well over a
hundred interpreters that each import it (doctor, the wrapper, gloo ranks). A zygote
(harness/_zygote.py) imports the engine's heavy modules once, never the pack, and forks one
child per command; the child takes the command's environment, working directory, arguments
and standard streams, and runs `python -m MODULE`, `python SCRIPT` or `python -c CODE` as a
fresh interpreter would (atexit handlers, exit status, a traceback on an uncaught error).

`run` and `popen` stand in for subprocess.run and subprocess.Popen, and `warm_spawn` makes a
multiprocessing spawn context start its children (`python -c 'from multiprocessing.spawn import
spawn_main; ...' --multiprocessing-fork`, with the pipes it passes) from a zygote. A zygote serves only
children whose environment matches its own in everything that shapes imports: any variable
may differ only if it is read when the command runs (LATE), so a different PYTHONPATH, an
SGLANG_ variable or an injected Kubernetes variable gets a zygote of its own. Anything the
zygote cannot serve (another interpreter, interpreter options other than -P, DSV41_ZYGOTE=0) runs as a
plain subprocess.

Another tree's engine (first on PYTHONPATH) cannot come from a parent that imported the installed
one: a dependencies-only parent, which imported what the installed engine's zygote imported but
the engine, forks that tree's zygote, and the one-off children of `popen_once`; each imports its own
engine (about 2 s instead of 8 to 12). A path that would shadow one of its modules gets a fresh start.
"""

from __future__ import annotations

import atexit
import collections
import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from typing import Optional

from .engines import ROOT

# Read by the pack or the command when it runs, never while the engine imports (the multicast
# switches of harness.nccl.NO_MULTICAST when NCCL and symmetric memory start).
# COLUMNS and LINES: a terminal library of the test process may put them in its C environment
# (what a spawned child inherits) without os.environ knowing; only a terminal's width reads them.
# DSV41_ADAPTERS_SNAPSHOT_KERNEL (and its old name SGLANG_ADAPTERS_SNAPSHOT_KERNEL): the pack reads it
# when the fence first needs its copy; DSV41_ADAPTERS_PROOF_CACHE (SGLANG_ADAPTERS_PROOF_CACHE), whenever
# it looks up or keeps a proof.
# REQUIRED_FLAGS: the image build's argument, which its doctor command reads through the shell.
# PROMETHEUS_MULTIPROC_DIR (and its old lower-case name): prometheus_client picks where metric values
# live when it is imported; a zygote's child picks again in its own environment (_zygote.py).
# SGLANG_PLUGINS and SGLANG_SPEC_TP_SYNC: the engine reads them with envs.X.get() when it loads
# its plugins (sglang.srt.plugins.load_plugins) and builds a SpecTpSync (its __init__), on every
# release that has them; the preload never does either (it would import the pack, refused there).
LATE = ("PATH", "RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK", "PYTEST_CURRENT_TEST",
        "PYTEST_XDIST_WORKER", "PYTEST_XDIST_WORKER_COUNT", "PYTEST_XDIST_TESTRUNUID",
        "NCCL_NVLS_ENABLE", "TORCH_SYMM_MEM_DISABLE_MULTICAST", "NVSHMEM_DISABLE_NVLS", "COLUMNS", "LINES",
        "SGLANG_ADAPTERS_SNAPSHOT_KERNEL", "SGLANG_ADAPTERS_PROOF_CACHE", "SGLANG_PLUGINS", "SGLANG_SPEC_TP_SYNC",
        "REQUIRED_FLAGS", "PROMETHEUS_MULTIPROC_DIR", "prometheus_multiproc_dir")
# The pack's flags, and the near-misses of them it reports (DSV4_..., dsv41_...): read by the pack only.
LATE_PREFIXES = ("DSV4", "dsv4")
# Warm parents per test process (about 0.9 GB each); the least recently used one goes first.
# HARNESS_ZYGOTES lowers it where several test runs share a small machine.
KEEP = max(1, int(os.environ.get("HARNESS_ZYGOTES", "6")))


class Unavailable(RuntimeError):
    """No warm parent for this environment (its engine does not import)."""


def _early(env: dict) -> dict:
    return {k: v for k, v in env.items() if k not in LATE and not k.startswith(LATE_PREFIXES)}


class _Zygote:
    """A warm parent: the engine imported (an engine zygote), or with `listing`, the engine's
    dependencies only (a dependencies-only parent). `parent`: a dependencies-only parent to start
    from, where the engine is another tree's (a few seconds instead of ten)."""

    def __init__(self, interpreter: str, env: dict, listing: Optional[str] = None, parent: "Optional[_Zygote]" = None):
        self.folder = tempfile.mkdtemp(prefix="zygote-")
        self.address = os.path.join(self.folder, "socket")
        self.log = os.path.join(self.folder, "log")
        server = str(ROOT / "harness" / "_zygote.py")  # by path: the interpreter may not see this checkout
        args = [interpreter, server, self.address, *(["--dependencies", listing] if listing else [])]
        with open(self.log, "wb") as log:
            if parent is not None:
                self.proc = Child(args, cwd=ROOT, env=env, stdout=log, stderr=log, parent=parent)
            else:
                self.proc = subprocess.Popen(args, cwd=ROOT, env=env, stdin=subprocess.DEVNULL, stdout=log, stderr=log)
        self.ready, self.forked = False, parent is not None
        self.listing, self.top_level = listing, set()
        self.early = env
        self.defaults: dict = {}  # what importing the engine set in the zygote's os.environ (setdefault)
        self.engine_defaults: dict = {}  # a dependencies-only parent's: what its children's engine sets so

    def connect(self) -> socket.socket:
        self.wait_ready()
        conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        conn.connect(self.address)
        return conn

    def wait_ready(self) -> None:
        """Until the zygote listens; Unavailable if it exited (its engine does not import here)."""
        deadline = time.monotonic() + 300
        while not self.ready:
            if self.proc.poll() is not None:  # the engine does not import here: the command will say why
                with open(self.log, errors="replace") as log:
                    raise Unavailable(f"the zygote exited {self.proc.returncode}: {log.read()[-2000:]}")
            if os.path.exists(self.address + ".ready"):
                with open(self.address + ".ready") as ready:
                    self.defaults = json.load(ready)
                if self.listing:
                    with open(self.listing) as listing:
                        self.top_level = {name.partition(".")[0] for name in listing.read().split()}
                self.ready = True
            elif time.monotonic() > deadline:
                raise RuntimeError("the zygote did not start within 300 s")
            else:
                time.sleep(0.05)

    def serves(self, early: dict) -> bool:
        """Whether `early` is this zygote's environment once the variables importing the engine
        sets to the same values are left aside (a test process that has imported the engine has
        them; sglang sets its cache folders with os.environ.setdefault)."""
        defaults = {**self.defaults, **self.engine_defaults}
        return self.ready and _without(early, defaults) == _without(self.early, defaults)

    def close(self) -> None:
        self.proc.kill()
        self.proc.wait()
        shutil.rmtree(self.folder, ignore_errors=True)


_warm: "collections.OrderedDict[tuple, _Zygote]" = collections.OrderedDict()
_dependencies: dict = {}  # (interpreter, environment) -> its dependencies-only parent
_lock = threading.RLock()
HOME = str(ROOT)  # the PYTHONPATH of the installed engine's zygote, whose imports a dependencies-only parent makes


def _without(env: dict, defaults: dict) -> dict:
    return {k: v for k, v in env.items() if defaults.get(k) != v}


def _serving(parents: dict, key: tuple, early: dict) -> Optional[tuple]:
    """The key in `parents` of the one that serves `early` (the parent made for `key` first), or None."""
    if key in parents:
        return key
    return next((k for k, parent in parents.items() if k[0] == key[0] and parent.serves(early)), None)


def _zygote_for(interpreter: str, env: dict) -> _Zygote:
    early = _early(env)
    key = (interpreter, tuple(sorted(early.items())))
    with _lock:
        found = _serving(_warm, key, early)
        if found is not None:
            _warm.move_to_end(found)
            return _warm[found]
        parent = None if early.get("PYTHONPATH") == HOME else _dependencies_for(interpreter, early)
        while len(_warm) >= KEEP:
            # a tree's zygote first (forked from a dependencies-only parent: a second or two to make
            # again), before one that imported everything itself (the installed engine's: five or more)
            cheap = [k for k, z in _warm.items() if z.forked]
            _warm.pop(cheap[0] if cheap else next(iter(_warm))).close()
        _warm[key] = _Zygote(interpreter, early, parent=parent)
        return _warm[key]


def _beside_engine(early: dict) -> dict:
    """What a dependencies-only parent must share with a child: all but the import path and the
    engine's own variables (read when the child imports its engine)."""
    return {k: v for k, v in early.items() if k != "PYTHONPATH" and not k.startswith("SGLANG_")}


def _shadows(entry: str, names: set) -> bool:
    """Whether the folder `entry` holds a module or package of one of the top-level `names`."""
    try:
        found = os.listdir(entry)
    except OSError:
        return False
    return any(name.partition(".")[0] in names for name in found if not name.endswith((".dist-info", ".egg-info", ".pth")))


def _dependencies_for(interpreter: str, early: dict) -> Optional[_Zygote]:
    """The dependencies-only parent for children of `early`, where its path shadows none of the
    modules that parent imported (another tree's engine, never another torch); None elsewhere."""
    beside = _beside_engine(early)
    key = (interpreter, tuple(sorted(beside.items())))
    with _lock:
        try:
            # As with an engine zygote, the variables importing the engine sets to the same values
            # may differ (a test process that has imported it has them): the child's engine sets them.
            found = _serving(_dependencies, key, beside)
            if found is None:
                home = _zygote_for(interpreter, {**beside, "PYTHONPATH": HOME})
                home.wait_ready()
                parent = _dependencies[key] = _Zygote(interpreter, beside, listing=home.address + ".modules")
                parent.engine_defaults = home.defaults
            else:
                parent = _dependencies[found]
            parent.wait_ready()
        except Unavailable:
            return None
    entries = [entry for entry in early.get("PYTHONPATH", "").split(os.pathsep) if entry]
    return None if any(_shadows(entry, parent.top_level) for entry in entries) else parent


def popen_once(args, **kwargs):
    """subprocess.Popen(args, **kwargs) for a Python command whose environment is used once (a tree's):
    a child of a dependencies-only parent where one serves, which imports the engine itself as a fresh
    interpreter does, without a warm parent kept for that environment."""
    python = _servable(args, kwargs)
    if python is not None:
        parent = _dependencies_for(python[0], _early(dict(os.environ if kwargs.get("env") is None else kwargs["env"])))
        if parent is not None:
            return Child(args, parent=parent, **kwargs)
    return subprocess.Popen(args, **kwargs)


@atexit.register
def _close_all() -> None:
    while _warm:
        _warm.popitem()[1].close()
    while _dependencies:
        _dependencies.popitem()[1].close()


def _as_python(args) -> Optional[list]:
    """`args` as [interpreter, ...] where this interpreter's build runs it: this one or a venv
    of it, directly or through a script's #! line (a console script); else None."""
    args = [str(a) for a in args]
    if os.environ.get("DSV41_ZYGOTE", "1") == "0" or not args:
        return None
    if os.path.realpath(args[0]) != os.path.realpath(sys.executable):
        try:
            with open(args[0], "rb") as script:
                first = script.readline(512)
        except OSError:
            return None
        if not first.startswith(b"#!") or len(first[2:].split()) != 1:
            return None
        interpreter = first[2:].strip().decode()
        if os.path.realpath(interpreter) != os.path.realpath(sys.executable):
            return None
        args = [interpreter, *args]
    command = args[1:]
    while command[:1] == ["-P"]:  # no unsafe path first on sys.path: the child leaves it off too (_zygote.py)
        command = command[1:]
    if not command or command[0].startswith("-") and not (command[0] in ("-m", "-c") and len(command) > 1):
        return None
    return args


class Child:
    """The part of subprocess.Popen the tests use, for a child of a zygote."""

    def __init__(self, args, *, cwd=None, env=None, stdin=None, stdout=None, stderr=None, text=False, parent=None):
        self.args = [str(a) for a in args]
        python = _as_python(args)
        env = dict(os.environ if env is None else env)
        self.text = text
        self.returncode = None
        self._conn = (parent or _zygote_for(python[0], env)).connect()
        theirs = []
        stdin_fd = os.open(os.devnull, os.O_RDONLY)
        self.stdin = None
        if stdin == subprocess.PIPE:
            os.close(stdin_fd)
            stdin_fd, write = os.pipe()
            self.stdin = os.fdopen(write, "w" if text else "wb")
        theirs.append(stdin_fd)
        self.stdout = self.stderr = None
        for name, wanted in (("stdout", stdout), ("stderr", stderr)):
            if wanted == subprocess.PIPE:
                read, write = os.pipe()
                setattr(self, name, os.fdopen(read, "r" if text else "rb"))
                theirs.append(write)
            elif wanted == subprocess.STDOUT:
                theirs.append(theirs[-1])
            elif wanted == subprocess.DEVNULL:
                theirs.append(os.open(os.devnull, os.O_WRONLY))
            else:
                theirs.append(os.dup(wanted.fileno() if hasattr(wanted, "fileno") else (1 if name == "stdout" else 2)))
        request = {"args": python[1:], "env": env, "cwd": str(cwd or os.getcwd())}
        socket.send_fds(self._conn, [json.dumps(request).encode() + b"\n"], theirs)
        for fd in set(theirs):
            os.close(fd)
        self._reply = self._conn.makefile("r")
        self.pid = int(self._reply.readline())
        self._outputs: dict = {}
        self._readers = [threading.Thread(target=self._drain, args=(name,), daemon=True) for name in ("stdout", "stderr")]
        if self.stdin is None:  # one the caller talks to (its stdin a pipe) is read by the caller, as Popen's is
            self._read()
        self._waiter = threading.Thread(target=self._await_status, daemon=True)
        self._waiter.start()

    def _drain(self, name) -> None:
        stream = getattr(self, name)
        self._outputs[name] = stream.read() if stream else None

    def poll(self):
        return None if self._waiter.is_alive() else self.returncode

    def _await_status(self) -> None:
        line = self._reply.readline()
        self.returncode = int(line) if line.strip() else -signal.SIGKILL  # the zygote died with it
        self._conn.close()

    def wait(self, timeout=None):
        self._waiter.join(timeout)
        if self._waiter.is_alive():
            raise subprocess.TimeoutExpired(self.args, timeout)
        return self.returncode

    def _read(self) -> None:
        for reader in self._readers:
            if reader.ident is None:
                reader.start()

    def communicate(self, input=None, timeout=None):
        self._read()
        if self.stdin is not None:
            with self.stdin:
                if input:
                    self.stdin.write(input)
            self.stdin = None
        deadline = None if timeout is None else time.monotonic() + timeout
        for reader in self._readers:
            reader.join(None if deadline is None else max(0.0, deadline - time.monotonic()))
            if reader.is_alive():
                raise subprocess.TimeoutExpired(self.args, timeout)
        self.wait(None if deadline is None else max(0.1, deadline - time.monotonic()))
        for stream in (self.stdout, self.stderr):
            if stream:
                stream.close()
        return self._outputs["stdout"], self._outputs["stderr"]

    def kill(self):
        if self.returncode is None:
            try:
                os.kill(self.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass

    terminate = kill

    def send_signal(self, sig):
        os.kill(self.pid, sig)


def _servable(args, kwargs) -> Optional[list]:
    """_as_python(args) where a warm parent's child can take the call's keywords, else None."""
    python = _as_python(args)
    return python if python is not None and not set(kwargs) - {"cwd", "env", "stdin", "stdout", "stderr", "text"} else None


def popen(args, **kwargs):
    """subprocess.Popen(args, **kwargs), from a zygote where it can serve the command."""
    if _servable(args, kwargs) is not None:
        try:
            return Child(args, **kwargs)
        except Unavailable:
            pass
    return subprocess.Popen(args, **kwargs)


def run(args, *, capture_output=False, timeout=None, input=None, check=False, once=False, **kwargs):
    """subprocess.run(args, ...), from a zygote where it can serve the command (`once`: popen_once's)."""
    if capture_output:
        kwargs.update(stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    if input is not None:
        kwargs["stdin"] = subprocess.PIPE
    proc = (popen_once if once else popen)(args, **kwargs)
    try:
        out, err = proc.communicate(input=input, timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate()
        raise
    done = subprocess.CompletedProcess(proc.args, proc.returncode, out, err)
    if check:
        done.check_returncode()
    return done


# The executable a multiprocessing spawn context runs, standing in for the interpreter: it hands
# its arguments, environment, working directory and every descriptor it inherited (the standard
# streams and the pipes multiprocessing passes) to the zygote, forwards signals to the child, and
# exits as the child did. An environment that differs in what shapes imports from the zygote's
# (the test changed one after warm_spawn began) gets the interpreter itself.
_TRAMPOLINE = r"""#!{python} -S
import json, os, signal, socket, sys
ADDRESS, PYTHON, EARLY, DEFAULTS, LATE, PREFIXES = {address!r}, {python!r}, {early!r}, {defaults!r}, {late!r}, {prefixes!r}
early = {{k: v for k, v in os.environ.items() if k not in LATE and not k.startswith(PREFIXES) and DEFAULTS.get(k) != v}}
if early != EARLY:
    os.execv(PYTHON, [PYTHON, *sys.argv[1:]])
fds = [0, 1, 2]
for name in os.listdir("/proc/self/fd"):
    fd = int(name)
    if fd > 2:
        try:
            os.fstat(fd)
            fds.append(fd)
        except OSError:
            pass  # the listing's own descriptor, closed by now
conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
conn.connect(ADDRESS)
request = dict(args=sys.argv[1:], env=dict(os.environ), cwd=os.getcwd(), fds=fds[3:])
socket.send_fds(conn, [json.dumps(request).encode() + b"\n"], fds)
reply = conn.makefile("r")
pid = int(reply.readline())
for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2):
    signal.signal(sig, lambda number, frame: os.kill(pid, number))
line = reply.readline()
code = int(line) if line.strip() else -signal.SIGKILL
if code < 0:
    signal.signal(-code, signal.SIG_DFL)
    os.kill(os.getpid(), -code)
os._exit(code)
"""


@contextlib.contextmanager
def warm_spawn(context):
    """Inside, the multiprocessing spawn `context` starts its children from a warm parent for the
    current environment (set it first: the children inherit os.environ at start()). The child is
    what a spawn child is (spawn_main, the pickled target, the parent's pipes), only its interpreter
    started with the engine imported. Without a parent for this environment, the interpreter itself."""
    from multiprocessing import spawn

    before = spawn.get_executable()
    try:
        zygote = _zygote_for(sys.executable, dict(os.environ))
        zygote.wait_ready()
    except Unavailable:
        yield
        return
    path = os.path.join(zygote.folder, "python")
    if not os.path.exists(path):
        with open(path, "w") as script:
            script.write(_TRAMPOLINE.format(python=sys.executable, address=zygote.address, late=LATE, prefixes=LATE_PREFIXES,
                                            early=_without(zygote.early, zygote.defaults), defaults=zygote.defaults))
        os.chmod(path, 0o755)
    context.set_executable(path)
    try:
        yield
    finally:
        context.set_executable(before)
