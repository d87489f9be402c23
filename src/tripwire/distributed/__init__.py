"""Several ranks: one rank's stop becomes every rank's stop, through the job's torch.distributed store.

Counters are per process. Without help, a rank that stops leaves its tensor/pipeline peers blocked inside the next
collective until the NCCL watchdog fires (minutes later) and the cause drowns in a multi-rank timeout.
:func:`coordinate` connects a :class:`~tripwire.Monitor` to a ``torch.distributed`` store:

* **Publish.** When this rank's stop is armed for a local reason (a fatal site, any hit under ``raise``, a lost
  reader, a fatal hit confirmed by ``drain()`` at shutdown), a JSON record (rank, site, device, count, first
  offender, message, host, pid, time) is written under one job-scoped key with ``compare_set`` from "absent", so
  the first rank to publish wins and later ones never overwrite it. A stop learned from a peer is never re-published.
* **Learn.** Every ``store_poll`` seconds (``TRIPWIRE_STORE_POLL``, default 0.5 s) the key is checked with
  ``store.check([key])`` (one non-blocking round trip; ``get`` only once it exists). When a peer published, this rank
  arms its own stop with a :class:`~tripwire.GuardTripped` whose ``rank`` is the peer's and whose message carries
  the peer's message; the engine raises it at its next ``tripwire.check()``. Nothing runs on the engine thread,
  nothing is a collective, and nothing runs on the reader's ticks: they stay native (the store poll would otherwise
  make every tick a Python tick, each holding the engine's GIL).
* **Abort** (``abort=True``). On any stop (local or learned) the process groups are aborted (``ProcessGroup.abort``,
  which for NCCL is ``ncclCommAbort`` of every communicator), so a thread blocked inside a collective returns at once
  with an error instead of waiting for the watchdog. The stop is armed *before* the abort, so an engine that catches
  the collective's error finds the GuardTripped already there (:meth:`Coordinator.raise_if_stopped`,
  :meth:`Coordinator.guarded`). After an abort the groups are unusable: the engine must exit or rebuild them.

Threads. The store calls run on a ``tripwire-coord`` thread, at the poll cadence (and at once to publish). A
``tripwire-coord-watch`` thread watches it: a TCPStore whose server is alive but stalled (SIGSTOP, a wedged host, a
dropped network path) makes ``check()`` block indefinitely -- the client's timeout does not bound it (a SIGSTOPped
master blocks ``check()`` far past it). A call outstanding longer than ``store_timeout`` counts as a failure at every
poll slot it occupies; a call that raises counts once. After ``max_store_failures`` consecutive failures the
rank arms with "coordination lost" (its peers can no longer reach it, nor it them): about ``max_store_failures x
store_poll`` seconds of a store that refuses connections, ``store_timeout`` more of one that stopped answering. The
abort runs on its own short-lived thread, so a hung store cannot delay it either.

Latency. The firing rank arms about one reader interval after the hit (its reader sees the rise on its next tick and
re-polls at once for the confirming copy) and publishes at once; a peer sees the record at its next poll: peers
raise within about one reader interval plus one ``store_poll`` of the hit.

Load on the store. Each rank sends one ``check`` (a ~30-byte request, a ~10-byte reply) per ``store_poll``; a
published stop adds one ``compare_set`` and, on every peer, one ``get``. At the default 0.5 s: 128 requests/s at 64
ranks, 1,024/s at 512, 8,192/s at 4,096, all on the one TCPStore master (the job's rendezvous store). See
``benchmarks/RESULTS.md`` (the store's load) for what one master serves; at thousands of ranks raise
``store_poll`` (1-2 s) or give ``coordinate`` a store of its own.

Scope of the key. ``{key_prefix}/stop`` inside the given store. The default process group's store is already
scoped to the job (and, under torchrun, to the restart attempt); a store you pass in must be private to the job,
or use a ``key_prefix`` unique to it: a record left from an earlier job under the same key stops the new one at once.
"""

from __future__ import annotations

from .coordinator import (
    COORDINATION_SITE,
    DEFAULT_MAX_STORE_FAILURES,
    DEFAULT_STORE_TIMEOUT,
    Coordinator,
    coordinate,
)

__all__ = [
    "COORDINATION_SITE",
    "DEFAULT_MAX_STORE_FAILURES",
    "DEFAULT_STORE_TIMEOUT",
    "Coordinator",
    "coordinate",
]
