"""The job's store: the default process group's, a private client of it, and the values it returns."""

from __future__ import annotations

import logging
from datetime import timedelta
from typing import Any

import torch

log = logging.getLogger("tripwire")


def pg_initialized() -> bool:
    dist = torch.distributed
    return bool(dist.is_available() and dist.is_initialized())


def default_store() -> Any:
    """The default process group's store (the job's rendezvous store, prefixed for the default group)."""
    from torch.distributed import distributed_c10d as c10d

    getter = getattr(c10d, "_get_default_store", None)
    if getter is not None:
        return getter()
    try:  # older layouts: _world.pg_map[pg] = (backend, store)
        return c10d._world.pg_map[c10d._get_default_group()][1]
    except Exception as e:
        raise RuntimeError(
            "tripwire: cannot find the default process group's store in this torch; pass store=... to coordinate()"
        ) from e


def private_client(store: Any, timeout: float) -> Any:
    """A clone of ``store`` (its own connection) with ``timeout``; the store itself when it cannot be cloned. The
    job's store is never modified (its timeout governs the job's own rendezvous and barriers)."""
    clone = getattr(store, "clone", None)
    if not callable(clone):
        return store
    try:
        private = clone()
        private.set_timeout(timedelta(seconds=timeout))
        return private
    except Exception as e:
        log.debug("could not clone the store (%s); using it directly", e)
        return store


def as_bytes(v: Any) -> bytes:
    if isinstance(v, bytes):
        return v
    if isinstance(v, str):
        return v.encode()
    return bytes(v)


def opt_int(v: Any) -> int | None:
    return None if v is None else int(v)
