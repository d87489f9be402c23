"""A test that leaves a non-daemon thread running fails, naming the thread.

The interpreter joins every non-daemon thread at exit: one left running (a serving engine's generation loop that a
test never stopped) keeps pytest alive after its summary until CI's time limit kills it, a red run that names no test.
So each test module's new non-daemon threads are checked when the module ends (after its class and module fixtures
closed what they serve; a short grace for threads that are ending): they fail the module's last test, naming the
module and the threads. A session that still has one at its end reports them and exits with status 1 (or the
session's own failing status) instead of waiting forever.
"""

from __future__ import annotations

import os
import sys
import threading
import time

import pytest

GRACE_S = 5.0


def _pool_worker(t: threading.Thread) -> bool:
    # concurrent.futures' workers are non-daemon, but the interpreter stops and joins them itself at exit (a
    # library's lazily made pool, e.g. inductor's compile pool, never hangs it).
    target = getattr(t, "_target", None)
    return getattr(target, "__module__", None) == "concurrent.futures.thread"


def _alive_non_daemon(before: set[int] | None = None) -> list[threading.Thread]:
    return [
        t
        for t in threading.enumerate()
        if t is not threading.main_thread()
        and not _pool_worker(t)
        and not t.daemon
        and t.is_alive()
        and (before is None or id(t) not in before)
    ]


def _wait_out(threads: list[threading.Thread]) -> list[threading.Thread]:
    deadline = time.monotonic() + GRACE_S
    for t in threads:
        t.join(max(0.0, deadline - time.monotonic()))
    return [t for t in threads if t.is_alive()]


@pytest.fixture(autouse=True, scope="module")
def _no_thread_left_behind(request):
    before = {id(t) for t in threading.enumerate()}
    yield
    left = _wait_out(_alive_non_daemon(before))
    if left:
        pytest.fail(
            f"{request.module.__name__} left {len(left)} non-daemon thread(s) running: "
            f"{', '.join(t.name for t in left)}; the "
            f"interpreter would wait for them forever at exit (stop or close what started them)",
            pytrace=False,
        )


_status: list[int] = []


def pytest_sessionfinish(session, exitstatus):
    _status.append(int(exitstatus))


def pytest_unconfigure(config):
    left = _wait_out(_alive_non_daemon())
    if left:
        sys.stderr.write(
            f"\ntripwire tests: {len(left)} non-daemon thread(s) still running at the end of the session "
            f"({', '.join(t.name for t in left)}): exiting with status 1 instead of waiting for them\n"
        )
        sys.stderr.flush()
        sys.stdout.flush()
        # The session's own status where it was a failure already (interrupted, usage error, no tests...), else 1.
        os._exit((_status[-1] if _status else 0) or 1)
