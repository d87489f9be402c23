"""The coordinator: :func:`coordinate` and :class:`Coordinator` (see :mod:`tripwire.distributed`)."""

from __future__ import annotations

import collections
import contextlib
import json
import logging
import math
import os
import threading
import time
import weakref
from collections.abc import Iterator, Sequence
from typing import Any

import torch

from .._default import default_monitor
from .._runtime.capture import relax_thread_capture_mode
from ..errors import GuardTripped
from ..monitor import Monitor
from ._abort import abort_groups, all_groups
from ._record import peer_stop, read_record, stop_record
from ._store import as_bytes, default_store, pg_initialized, private_client

__all__ = [
    "COORDINATION_SITE",
    "DEFAULT_MAX_STORE_FAILURES",
    "DEFAULT_STORE_TIMEOUT",
    "Coordinator",
    "coordinate",
]


log = logging.getLogger("tripwire")

# 20 consecutive failures: 20 polls of a store that refuses connections (10 s at the default 0.5 s poll), or
# store_timeout more of a store that stopped answering. A dead TCPStore master does not come back (it lives in rank
# 0's process or the launcher), so waiting longer only delays the stop.
DEFAULT_MAX_STORE_FAILURES = 20
DEFAULT_STORE_TIMEOUT = 2.0
# The site name of a stop armed because the store became unreachable (never published: the store is the problem).
COORDINATION_SITE = "<coordination>"

_coordinated: weakref.WeakKeyDictionary[Monitor, Coordinator] = weakref.WeakKeyDictionary()
_coordinated_lock = threading.Lock()


def coordinate(
    store: Any = None,
    *,
    group: Any = None,
    rank: int | None = None,
    abort: bool = True,
    monitor: Monitor | None = None,
    key_prefix: str = "tripwire",
    max_store_failures: int = DEFAULT_MAX_STORE_FAILURES,
    store_timeout: float = DEFAULT_STORE_TIMEOUT,
    store_poll: float | None = None,
) -> Coordinator:
    """Coordinate ``monitor``'s stop (default: the default monitor) with every rank of the job. Call it on every
    rank, after ``torch.distributed.init_process_group`` (or with a store), before or after ``tripwire.start()``.

    ``store``: a ``torch.distributed`` Store reachable by every rank (TCPStore, FileStore, a PrefixStore over one).
    ``None`` uses the default process group's store; with no process group either, RuntimeError. The store is
    cloned when it supports it (a private connection with ``store_timeout``; the job's store is left untouched).
    ``group``: the process group (or a sequence of them) to abort; ``None`` aborts every group of this process.
    ``rank``: the rank named in this rank's record; default ``torch.distributed.get_rank()``, else ``$RANK``.
    ``abort``: abort the group(s) on any stop, so a thread blocked in a collective returns with an error.
    ``key_prefix``: the record lives at ``{key_prefix}/stop``; every rank must use the same prefix.
    ``max_store_failures``: consecutive failed (or overdue) store calls after which this rank arms "coordination
    lost". ``store_timeout``: seconds after which an outstanding store call counts as failed. ``store_poll``:
    seconds between polls of the store (default: the monitor's ``store_poll`` setting, ``TRIPWIRE_STORE_POLL``).

    Returns the :class:`Coordinator`; ``close()`` it to detach. One coordinator per monitor at a time.
    """
    mon = monitor if monitor is not None else default_monitor()
    if not isinstance(mon, Monitor):
        raise TypeError(f"coordinate(monitor=...) expects a tripwire.Monitor, got {type(mon).__name__}")
    if isinstance(max_store_failures, bool) or not isinstance(max_store_failures, int) or max_store_failures < 1:
        raise ValueError(f"max_store_failures={max_store_failures!r}: expected a whole number >= 1")
    if isinstance(store_timeout, bool) or not isinstance(store_timeout, (int, float)):
        raise ValueError(f"store_timeout={store_timeout!r}: expected a number of seconds")
    if not math.isfinite(store_timeout) or store_timeout <= 0:
        raise ValueError(f"store_timeout={store_timeout!r}: expected a finite number of seconds > 0")
    # Validated like every setting (fail closed): a broken cadence must not silently stop the polling.
    poll_s = (
        mon.settings.store_poll if store_poll is None else mon.settings.with_overrides(store_poll=store_poll).store_poll
    )
    if not isinstance(key_prefix, str) or not key_prefix:
        raise ValueError(f"key_prefix={key_prefix!r}: expected a non-empty string")

    initialized = pg_initialized()
    if store is None:
        if not initialized:
            raise RuntimeError(
                "tripwire.distributed.coordinate(): no store was given and no torch.distributed process group is "
                "initialised, so there is nothing to publish a stop through. Call "
                "torch.distributed.init_process_group(...) first (its store is used), or pass the job's store, e.g. "
                "coordinate(torch.distributed.TCPStore(host, port, is_master=False), rank=rank)."
            )
        store = default_store()
    for op in ("check", "get"):
        if not callable(getattr(store, op, None)):
            raise TypeError(
                f"coordinate(store=...): {type(store).__name__} has no {op}(); pass a torch.distributed Store"
            )
    if rank is None:
        if initialized:
            rank = int(torch.distributed.get_rank())
        elif os.environ.get("RANK", "").strip().isdigit():
            rank = int(os.environ["RANK"])
        else:
            raise ValueError(
                "coordinate(): cannot tell this process's rank (no process group, no $RANK): pass rank=..."
            )
    if isinstance(rank, bool) or not isinstance(rank, int) or rank < 0:
        raise ValueError(f"rank={rank!r}: expected a whole number >= 0")
    groups: list[Any] | None
    if group is None:
        groups = None
    elif isinstance(group, Sequence):
        groups = list(group)
    else:
        groups = [group]
    if mon.settings.mode == "off":
        log.warning(
            "coordinate() on a monitor in mode 'off': no reader thread runs, so this rank neither "
            "publishes a stop nor learns of its peers'"
        )
    with _coordinated_lock:
        old = _coordinated.get(mon)
        if old is not None and not old.closed:
            raise RuntimeError("this monitor is already coordinated; close() the existing Coordinator first")
        coord = Coordinator(
            mon,
            store,
            rank=rank,
            key=f"{key_prefix}/stop",
            abort=abort,
            groups=groups,
            max_store_failures=max_store_failures,
            store_timeout=float(store_timeout),
            store_poll=poll_s,
        )
        _coordinated[mon] = coord
    return coord


class Coordinator:
    """Publishes this rank's stop, learns its peers', and aborts the process groups. Built by :func:`coordinate`.

    Public state (for tools and tests; written by the background threads): ``store_failures`` (every failed or
    overdue store call), ``consecutive_failures``, ``polls`` (store checks done), ``published`` (the record this
    rank published, None until then), ``publish_won`` (whether it was first), ``peer`` (the peer record acted on),
    ``abort_done`` (an Event set once the abort ran), ``aborted`` (groups aborted), ``abort_errors``.
    """

    def __init__(
        self,
        monitor: Monitor,
        store: Any,
        *,
        rank: int,
        key: str,
        abort: bool,
        groups: list[Any] | None,
        max_store_failures: int,
        store_timeout: float,
        store_poll: float,
    ) -> None:
        self.monitor = monitor
        self.store_poll = store_poll
        self.rank = rank
        self.key = key
        self.abort_enabled = abort
        self.max_store_failures = max_store_failures
        self.store_timeout = store_timeout
        self._groups = groups
        self._store = private_client(store, store_timeout)
        self._cv = threading.Condition()  # guards everything below that two threads touch
        self._closed = False
        self._kick = False
        self._to_publish: dict[str, Any] | None = None
        self._published_raw: bytes | None = None
        self._publish_attempted = threading.Event()
        self._inflight_since: float | None = None
        self._lost = False
        self._peer_exc: GuardTripped | None = None
        self._seen_raw: bytes | None = None
        self._last_fail_log = float("-inf")
        self._fails_since_log = 0
        self._abort_thread: threading.Thread | None = None
        self.store_failures = 0
        self.consecutive_failures = 0
        self.polls = 0
        self.published: dict[str, Any] | None = None
        self.publish_won: bool | None = None
        self.peer: dict[str, Any] | None = None
        self.abort_done = threading.Event()
        self.aborted: list[str] = []
        self.abort_errors: list[str] = []
        self._spans: collections.deque[tuple[float, float]] | None = None
        self._thread = threading.Thread(target=self._io_loop, name="tripwire-coord", daemon=True)
        self._watch = threading.Thread(target=self._watch_loop, name="tripwire-coord-watch", daemon=True)
        self._thread.start()
        self._watch.start()
        monitor.add_arm_listener(self._on_arm)
        armed = monitor.armed
        if armed is not None:  # armed before coordinate(): its peers have not heard of it yet
            self._on_arm(armed)

    # ------------------------------------------------------------------ engine side
    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def stopped(self) -> GuardTripped | None:
        """The armed stop (local or a peer's), or None."""
        return self.monitor.armed

    def raise_if_stopped(self, cause: BaseException | None = None) -> None:
        """Raise the armed GuardTripped (chained to ``cause`` when given), if any; else return.

        Use it where a collective failed: after an abort, the collective's error is a consequence and the
        GuardTripped (armed before the abort) is the cause worth reporting."""
        exc = self.monitor.armed
        if exc is None:
            return
        # Without the previous raise's traceback (as Monitor.check): a retrying engine must not grow it forever.
        exc = exc.with_traceback(None)
        if cause is not None:
            raise exc from cause
        raise exc

    @contextlib.contextmanager
    def guarded(self) -> Iterator[None]:
        """``with coordinator.guarded(): dist.all_reduce(x)``: an exception raised inside while the stop is armed
        (a collective returning with an error because its group was aborted) becomes the armed GuardTripped,
        chained to that error. Other exceptions pass through unchanged."""
        try:
            yield
        except GuardTripped:
            raise
        except Exception as e:
            self.raise_if_stopped(cause=e)
            raise

    def close(self, timeout: float = 2.0) -> None:
        """Detach from the monitor (no more publishing, learning or aborting) and stop the store thread. An abort
        already running is not undone. Idempotent."""
        self.monitor.remove_arm_listener(self._on_arm)
        with self._cv:
            self._closed = True
            self._cv.notify_all()
        self._watch.join(timeout)
        self._thread.join(timeout)
        if self._thread.is_alive():  # stuck in a store call on a hung store: a daemon thread, it cannot block exit
            log.warning("the coordination thread is stuck in a store call; leaving it (daemon)")
        with _coordinated_lock:
            if _coordinated.get(self.monitor) is self:
                del _coordinated[self.monitor]

    def __enter__(self) -> Coordinator:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def clear(self) -> None:
        """Delete the job's stop record (a tool's call, e.g. before reusing a store; on the calling thread)."""
        self._store.delete_key(self.key)

    # ------------------------------------------------------------------ monitor callbacks
    def _on_arm(self, exc: GuardTripped) -> None:
        """Arm listener: runs on the thread that armed (the reader, the coordination thread, or drain's caller)."""
        if self._closed:
            return
        publish = exc is not self._peer_exc and exc.site != COORDINATION_SITE
        if publish:
            with self._cv:
                if self._lost or self.published is not None or self._to_publish is not None:
                    publish = False
                else:
                    self._to_publish = stop_record(self.rank, exc)
                    self._publish_attempted.clear()
                    self._kick = True
                    self._cv.notify_all()
        if self.abort_enabled:
            self._start_abort()
        # Off the reader thread (drain() at shutdown, user code), wait for the first publish attempt, so a stop
        # found at shutdown reaches the store before the process exits. The reader thread never waits.
        if publish and not self.monitor.on_reader_thread():
            self._publish_attempted.wait(self.store_timeout)

    def trace(self, on: bool | None = None) -> list[tuple[float, float]]:
        """The store rounds' and the watchdog's spans ``(start, end)`` in ``time.perf_counter`` seconds (the last
        few thousand); ``on`` switches recording (benchmarks: they run on threads that share the engine's GIL)."""
        if on is not None:
            self._spans = collections.deque(maxlen=8192) if on else None
        return list(self._spans or ())

    def _span(self, t0: float) -> None:
        spans = self._spans
        if spans is not None:
            spans.append((t0, time.perf_counter()))

    # ------------------------------------------------------------------ the coordination threads
    def _io_loop(self) -> None:
        """The store calls: a poll every ``store_poll`` (while not armed), a publish as soon as one is asked for."""
        next_poll = time.monotonic()
        while True:
            with self._cv:
                while not (self._kick or self._closed):
                    wait = next_poll - time.monotonic()
                    if wait <= 0:
                        break
                    self._cv.wait(wait)
                if self._closed:
                    return
                self._kick = False
                record = self._to_publish
                # Mode off: no reader, so this rank neither learns nor publishes by polling (the mode's contract).
                poll = self.monitor.armed is None and self.monitor.settings.mode != "off"
                if record is None and not poll:
                    next_poll = time.monotonic() + self.store_poll
                    continue
                self._inflight_since = time.monotonic()
            t0 = time.perf_counter()
            try:
                self._round(record, poll)
            except Exception:  # never let the thread die: a bug here must not end coordination silently
                log.exception("coordination round failed")
            finally:
                with self._cv:
                    self._inflight_since = None
                self._span(t0)
            next_poll = time.monotonic() + self.store_poll

    def _watch_loop(self) -> None:
        """Counts a store call outstanding past ``store_timeout`` as one failure per poll slot it occupies (the
        caller thread cannot: it is the one stuck). Never blocks on the store."""
        while True:
            with self._cv:
                if self._closed:
                    return
                self._cv.wait(self.store_poll)
                if self._closed:
                    return
                since = self._inflight_since
            now = time.monotonic()
            if since is None or now - since <= self.store_timeout:
                continue
            t0 = time.perf_counter()
            with self._cv:
                lost = self._failed_locked(TimeoutError(f"a store call has not returned for {now - since:.1f} s"), now)
            if lost is not None:
                self._lose(lost)
            self._span(t0)

    def _round(self, record: dict[str, Any] | None, poll: bool) -> None:
        found: bytes | None = None
        try:
            if record is not None:
                try:
                    self._publish(record)
                finally:
                    self._publish_attempted.set()
            if poll:
                self.polls += 1
                # check() is one round trip that never waits for the key; get() only once it exists.
                if self._store.check([self.key]):
                    found = as_bytes(self._store.get(self.key))
        except Exception as e:
            with self._cv:
                lost = self._failed_locked(e, time.monotonic())
            if lost is not None:
                self._lose(lost)
            return
        with self._cv:
            if self.consecutive_failures:
                log.warning(
                    "the coordination store answers again after %d failed call(s)",
                    self.consecutive_failures,
                )
            self.consecutive_failures = 0
        if found is not None:
            self._learn(found)

    def _publish(self, record: dict[str, Any]) -> None:
        raw = json.dumps(record, sort_keys=True).encode()
        won: bool
        try:
            # From "absent" ("" expected) to the record: the first publisher wins, nobody overwrites it.
            current = as_bytes(self._store.compare_set(self.key, "", raw))
            won = current == raw
        except (NotImplementedError, AttributeError):
            # Stores without compare_set: claim with an atomic counter, the claimant writes the record.
            won = int(self._store.add(f"{self.key}/claims", 1)) == 1
            if won:
                self._store.set(self.key, raw)
        with self._cv:
            self._to_publish = None
            self.published = record
            self.publish_won = won
            self._published_raw = raw
        if won:
            log.error("rank %d published its stop to %r; every coordinated rank will stop", self.rank, self.key)
        else:
            log.error(
                "rank %d stopped, but another rank had already published a stop to %r (kept)",
                self.rank,
                self.key,
            )

    def _learn(self, raw: bytes) -> None:
        if raw == self._published_raw or raw == self._seen_raw:
            return  # our own record, or one already acted on (before a reset)
        self._seen_raw = raw
        rec, peer_rank, unreadable = read_record(raw)
        if unreadable is not None:
            log.error("unreadable stop record at %r (%s); stopping anyway", self.key, unreadable)
        if peer_rank == self.rank and rec.get("pid") == os.getpid():
            return
        self.peer = rec
        exc = peer_stop(rec, peer_rank, self.rank)
        self._peer_exc = exc  # marks it for _on_arm: learned, not published again
        # Arm first: an engine whose collective fails because of the abort below must find the stop already armed.
        self.monitor.arm(exc)

    # ------------------------------------------------------------------ failures
    def _failed_locked(self, err: BaseException, now: float) -> str | None:
        self.store_failures += 1
        self.consecutive_failures += 1
        self._fails_since_log += 1
        if now - self._last_fail_log >= self.monitor.settings.report_every:
            log.warning(
                "coordination store call failed (%s: %s); %d failure(s) since the last line, %d in a row "
                "(this rank stops after %d)",
                type(err).__name__,
                str(err).splitlines()[0] if str(err) else "",
                self._fails_since_log,
                self.consecutive_failures,
                self.max_store_failures,
            )
            self._last_fail_log = now
            self._fails_since_log = 0
        if self.consecutive_failures >= self.max_store_failures and not self._lost:
            self._lost = True
            self._to_publish = None  # the store is the problem: stop retrying
            return (
                f"tripwire: coordination lost: {self.consecutive_failures} consecutive store calls failed (last: "
                f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}); rank {self.rank} can "
                f"neither publish a stop nor learn of its peers', so it stops"
            )
        return None

    def _lose(self, message: str) -> None:
        self.monitor.arm(GuardTripped(message, site=COORDINATION_SITE, device="*", count=0))

    # ------------------------------------------------------------------ abort
    def _start_abort(self) -> None:
        with self._cv:
            if self._abort_thread is not None:
                return
            # Its own thread: ncclCommAbort may take a while, and a hung store must not delay it.
            self._abort_thread = threading.Thread(target=self._abort_now, name="tripwire-abort", daemon=True)
        self._abort_thread.start()

    def _abort_now(self) -> None:
        try:
            if torch.cuda.is_initialized():
                # ncclCommAbort makes CUDA calls; relaxed, they cannot invalidate a capture the engine is making.
                relax_thread_capture_mode()
            groups = self._groups if self._groups is not None else all_groups()
            if not groups:
                log.info("no process group to abort")
                return
            t0 = time.monotonic()
            self.aborted, self.abort_errors = abort_groups(groups)
            log.error(
                "aborted %d process group(s) in %.3f s so peers blocked in a collective return%s",
                len(self.aborted),
                time.monotonic() - t0,
                f"; failures: {self.abort_errors}" if self.abort_errors else "",
            )
        except Exception as e:
            self.abort_errors.append(f"{type(e).__name__}: {e}")
            log.exception("aborting the process groups failed")
        finally:
            self.abort_done.set()
