"""The zygote of harness/zygote.py: import the engine once, then fork one child per request.

    PYTHON harness/_zygote.py SOCKET [--dependencies LISTING]

A request is one JSON line {"args", "env", "cwd", "fds"} with the child's stdin, stdout and
stderr, then one descriptor for each number in "fds" (optional: the pipes a multiprocessing
spawn child inherits, kept at their numbers); the reply is the child's pid, then its exit status (negative: the
signal that ended it), each on a line. Single-threaded, so that every fork is of a process
with one thread.
"""

import sys

if sys.path and sys.path[0] == __import__("os").path.dirname(__file__):
    del sys.path[0]  # run by path: its own folder is not the children's first import path

import atexit
import fcntl
import gc
import importlib
import json
import os
import runpy
import socket
import threading
import traceback
import types

# What doctor, the wrapper and the gloo ranks import: each child finds them imported.
PRELOAD = (
    "torch", "torch.distributed",
    "sglang.srt.server_args",
    "sglang.srt.distributed.parallel_state",
    "sglang.srt.speculative.spec_tp_sync",  # 0.5.19+
    "sglang.srt.speculative.dspark_components.dspark_verify",
    "sglang.srt.speculative.dspark_components.dspark_draft",
    "sglang.srt.speculative.dspark_components.dspark_draft_sampler",  # 0.5.17+
    "sglang.srt.speculative.dspark_components.dspark_worker_v2",
    "sglang.srt.speculative.dflash_worker_v2",
    "sglang.srt.model_executor.model_runner",
    "sglang.srt.managers.scheduler",
)
PACK = "sglang_dsv41_adapters"
# The harness's interpreters (this parent, its children, the test processes) collect cyclic garbage
# after 100,000 allocations instead of Python's 700: the engine's import and the following of its
# code make millions of objects and little cyclic garbage, and each young collection walks them.
# A test's outcome does not rest on when a cycle is freed; the product's own processes keep
# Python's defaults.
COLLECTION = (100_000, 50, 50)


_SET_BY_DEFAULT: dict = {}  # what importing the engine passed to os.environ.setdefault and holds


def preload() -> None:
    plain = type(os.environ).setdefault

    def setdefault(key, value=None):  # noted whether or not the variable was there already
        held = plain(os.environ, key, value)
        if held == value:
            _SET_BY_DEFAULT[key] = value
        return held

    os.environ.setdefault = setdefault  # this object's alone, while the engine imports
    try:
        for name in PRELOAD:
            try:
                importlib.import_module(name)
            except ModuleNotFoundError as exc:
                if not (exc.name and (name == exc.name or name.startswith(exc.name + "."))):
                    raise  # a module of this release that fails to import is an error, not a skip
    finally:
        del os.environ.setdefault
    if any(module == PACK or module.startswith(PACK + ".") for module in sys.modules):
        raise SystemExit("the engine imported the pack while loading: a zygote would hand children its decision")


_made: list = []  # the prometheus_client metric values made while this parent imported (none expected)


def watch_metric_values() -> None:
    """prometheus_client picks where every metric value lives (this process, or files under
    PROMETHEUS_MULTIPROC_DIR) once, when it is imported; a child picks again in its own
    environment (_pick_metric_values), which holds only while the parent made no value itself."""
    try:
        from prometheus_client import values
    except ImportError:
        return

    class Watched(values.MutexValue):
        def __init__(self, typ, metric_name, name, *args, **kwargs):
            _made.append(name)
            super().__init__(typ, metric_name, name, *args, **kwargs)

    values.ValueClass = Watched


def check_metric_values() -> None:
    """Stop where importing made a metric value; else the watch ends, the parent's choice made as a child's."""
    if _made:
        raise SystemExit(f"importing the engine made prometheus metric values ({', '.join(_made[:3])}): a child "
                         "could not take PROMETHEUS_MULTIPROC_DIR from its own environment (harness.zygote.LATE)")
    _pick_metric_values()


def _pick_metric_values() -> None:
    """prometheus_client's choice of where values live, made again in the child's environment,
    as a fresh interpreter importing it there would make it."""
    values = sys.modules.get("prometheus_client.values")
    if values is not None:
        values.ValueClass = values.get_value_class()


def _exit_code(code) -> int:
    if code is None:
        return 0
    if isinstance(code, int):
        return code & 0xFF
    print(code, file=sys.stderr)
    return 1


def child(request: dict, fds: list) -> None:
    """Become `python ARGS` in the request's environment, working directory and descriptors."""
    targets = [0, 1, 2, *request.get("fds", ())]
    high = [fcntl.fcntl(fd, fcntl.F_DUPFD, 1024) for fd in fds]  # out of every target's way
    for fd in set(fds):
        os.close(fd)
    for target, fd in zip(targets, high):
        os.dup2(fd, target)
        os.close(fd)
    os.environ.clear()
    os.environ.update(request["env"])
    _import_path(STARTED_WITH.get("PYTHONPATH"), request["env"].get("PYTHONPATH"))
    _pick_metric_values()
    os.chdir(request["cwd"])
    args = request["args"]
    safe_path = False
    while args[0] in ("-B", "-P"):
        if args[0] == "-B":  # what a spawn child's command line carries from a parent run with -B
            sys.dont_write_bytecode = True
        else:  # -P: nothing put first on sys.path for the command (its folder, the working one or "")
            safe_path = True
        args = args[1:]

    def first_on_path(entry: str) -> None:
        if not safe_path:
            sys.path.insert(0, entry)

    code = 0
    try:
        if args[0] == "-m":
            sys.argv = [args[1], *args[2:]]
            first_on_path(os.getcwd())
            runpy.run_module(args[1], run_name="__main__", alter_sys=True)
        elif args[0] == "-c":
            sys.argv = ["-c", *args[2:]]
            first_on_path("")
            main = types.ModuleType("__main__")
            sys.modules["__main__"] = main
            exec(compile(args[1], "<string>", "exec"), main.__dict__)
        else:
            sys.argv = list(args)
            first_on_path(os.path.dirname(os.path.abspath(args[0])))
            runpy.run_path(args[0], run_name="__main__")
    except SystemExit as exc:
        code = _exit_code(exc.code)
    except BaseException as exc:
        traceback.print_exception(type(exc), exc, exc.__traceback__.tb_next)  # from the command's frame on
        code = 1
    # What a normal interpreter exit does: wait for non-daemon threads, run atexit, flush.
    try:
        threading._shutdown()
        atexit._run_exitfuncs()
        sys.stdout.flush()
        sys.stderr.flush()
    finally:
        os._exit(code)


def _entries(value) -> list:
    return [os.path.abspath(entry) for entry in (value or "").split(os.pathsep) if entry]


def _import_path(ours, theirs) -> None:
    """sys.path as the child's PYTHONPATH makes it: a dependencies-only parent serves trees first
    on the path (their engine is not imported here, so the child imports it from there)."""
    if _entries(ours) == _entries(theirs):
        return
    own = set(_entries(ours))
    sys.path[:] = _entries(theirs) + [entry for entry in sys.path if os.path.abspath(entry) not in own]
    importlib.invalidate_caches()


def dependencies(listing: str) -> None:
    """Import what the engine imports, the engine itself left out (`listing`: module names, one a
    line, as an engine zygote wrote them): a child imports its own engine, from any tree, in a
    few seconds instead of ten. A module that does not import alone is left to the child."""
    with open(listing) as names:
        for name in names.read().split():
            try:
                importlib.import_module(name)
            except BaseException:  # noqa: BLE001 - the child imports it as the engine does, or says why
                pass
    engine = sorted(m for m in sys.modules if m == "sglang" or m.startswith(("sglang.", PACK)))
    if engine:
        raise SystemExit(f"importing the dependencies imported {engine[0]}: the children would not import their own")


def _request(conn: socket.socket):
    data, fds, _, _ = socket.recv_fds(conn, 1 << 16, 64)
    while not data.endswith(b"\n"):
        more = conn.recv(1 << 16)
        if not more:
            raise ConnectionError("the request ended early")
        data += more
    return json.loads(data), fds


STARTED_WITH = dict(os.environ)


def serve(address: str) -> None:
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(address)
    listener.listen(64)
    listener.settimeout(0.05)
    parent = os.getppid()
    waiting = {}  # pid -> the connection its status goes back on
    with open(address + ".starting", "w") as ready:  # what importing the engine set in os.environ, or would have
        json.dump({**{k: v for k, v in os.environ.items() if STARTED_WITH.get(k) != v},
                   **{k: v for k, v in _SET_BY_DEFAULT.items() if os.environ.get(k) == v}}, ready)
    os.replace(address + ".starting", address + ".ready")
    while os.getppid() == parent:  # the test process that started us is gone: so are we
        try:
            conn, _ = listener.accept()
        except (socket.timeout, TimeoutError):
            conn = None
        if conn is not None:
            conn.setblocking(True)
            request, fds = _request(conn)
            sys.stdout.flush()
            sys.stderr.flush()
            pid = os.fork()
            if pid == 0:
                listener.close()
                conn.close()
                child(request, fds)
            for fd in fds:
                os.close(fd)
            conn.sendall(f"{pid}\n".encode())
            waiting[pid] = conn
        while waiting:
            pid, status = os.waitpid(-1, os.WNOHANG)
            if pid == 0:
                break
            conn = waiting.pop(pid, None)
            if conn is not None:
                try:
                    conn.sendall(f"{os.waitstatus_to_exitcode(status)}\n".encode())
                except OSError:
                    pass  # the test stopped listening
                conn.close()


if __name__ == "__main__":
    gc.set_threshold(*COLLECTION)
    watch_metric_values()
    if sys.argv[2:3] == ["--dependencies"]:
        dependencies(sys.argv[3])
    else:
        preload()
        with open(sys.argv[1] + ".modules.starting", "w") as listing:  # what a dependencies-only parent imports
            listing.write("\n".join(m for m in sys.modules if not m.startswith(("sglang", "__main__"))))
        os.replace(sys.argv[1] + ".modules.starting", sys.argv[1] + ".modules")
    check_metric_values()
    # What the engine's import made is kept for good: a child's full collections skip it (about
    # half a second a doctor run) and its pages stay shared with the zygote's.
    gc.freeze()
    tasks = os.listdir("/proc/self/task") if os.path.isdir("/proc/self/task") else []
    if len(tasks) > 1:
        names = [open(f"/proc/self/task/{t}/comm").read().strip() for t in tasks]
        print(f"zygote: threads after loading the engine: {names}, python's {threading.enumerate()}; "
              "a fork copies only the main one", file=sys.stderr)
    serve(sys.argv[1])
