"""The stop record ranks publish through the store (:mod:`tripwire.distributed`): what a rank writes when its stop
is armed for a local reason, and the :class:`~tripwire.GuardTripped` a peer arms from it."""

from __future__ import annotations

import json
import os
import socket
import time
from typing import Any

from ..errors import GuardTripped
from ._store import opt_int


def stop_record(rank: int, exc: GuardTripped) -> dict[str, Any]:
    """The JSON record of ``rank``'s stop ``exc``: the stop's fields and message, and where and when it fired."""
    return {
        "rank": rank,
        "site": exc.site,
        "device": exc.device,
        "count": exc.count,
        "first_row": exc.first_row,
        "first_value": exc.first_value,
        "fatal": exc.fatal,
        "message": str(exc),
        "host": socket.gethostname(),
        "pid": os.getpid(),
        "time": time.time(),
    }


def read_record(raw: bytes) -> tuple[dict[str, Any], int, Exception | None]:
    """A published record as (record, its rank, None); an unreadable one as a stand-in record of rank -1 that
    still stops (fail closed) and the error that made it unreadable."""
    try:
        rec = json.loads(raw)
        return rec, int(rec["rank"]), None
    except (ValueError, KeyError, TypeError) as e:
        return {"rank": -1, "site": "<unreadable>", "device": "?", "count": 0, "message": repr(raw[:200])}, -1, e


def peer_stop(rec: dict[str, Any], peer_rank: int, rank: int) -> GuardTripped:
    """The stop ``rank`` arms for the record ``rec`` that ``peer_rank`` published: the peer's site, device, count,
    offender and message, and how long ago it fired by the peer's clock."""
    age = time.time() - float(rec.get("time", time.time()))
    where = f"{rec.get('host', '?')} pid {rec.get('pid', '?')}"
    return GuardTripped(
        f"tripwire: rank {peer_rank} ({where}) stopped {age:.2f} s ago by its clock and published its stop; "
        f"rank {rank} stops too. Rank {peer_rank} reported: {rec.get('message', '?')}",
        site=str(rec.get("site", "?")),
        device=str(rec.get("device", "?")),
        count=int(rec.get("count") or 0),
        first_row=opt_int(rec.get("first_row")),
        first_value=opt_int(rec.get("first_value")),
        rank=peer_rank,
        fatal=bool(rec.get("fatal", False)),
    )
