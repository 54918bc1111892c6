"""A progress line on stderr for a step a person waits on: once it has run a second (a step that
ends sooner is not waited on), then about every 10 s, through the pack's lines (framework.log)."""

from __future__ import annotations

import contextlib
import threading
import time

from . import log

PREFIX = "progress: "
FIRST, EVERY = 1.0, 10.0


@contextlib.contextmanager
def step(what: str, first: float = FIRST, every: float = EVERY):
    """Say `what` is running while the block runs (`progress: <what> (N s)`), never after it ended;
    `first` 0: at once, from this thread (a C import may hold the interpreter for seconds)."""
    done = threading.Event()
    start = time.monotonic()

    def say():
        log.emit(f"{PREFIX}{what} ({time.monotonic() - start:.0f} s)", progress=what)

    if first <= 0:
        say()

    def tell():
        wait = first if first > 0 else every
        while not done.wait(wait):
            say()
            wait = every

    teller = threading.Thread(target=tell, name="sglang-adapters-progress", daemon=True)
    teller.start()
    try:
        yield
    finally:
        done.set()
        teller.join()
