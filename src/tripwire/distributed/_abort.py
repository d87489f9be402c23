"""Aborting process groups (every NCCL communicator in one group call where it can), so that a thread blocked in a
collective returns at once."""

from __future__ import annotations

import logging
from typing import Any

import torch

from ._store import pg_initialized

log = logging.getLogger("tripwire")


def all_groups() -> list[Any]:
    """Every process group of this process, newest first (the order torch's own _abort_process_group uses)."""
    if not pg_initialized():
        return []
    from torch.distributed import distributed_c10d as c10d

    try:
        names = dict(c10d._world.pg_names)
    except Exception:
        return [c10d._get_default_group()]
    return sorted(names, key=lambda pg: names[pg], reverse=True)


def nccl_backend() -> Any:
    dist = torch.distributed
    try:
        if not (dist.is_available() and dist.is_nccl_available() and dist.is_initialized()):
            return None
        from torch.distributed import distributed_c10d as c10d

        backend = c10d._get_default_group()._get_backend(torch.device("cuda"))
        return backend if isinstance(backend, dist.ProcessGroupNCCL) else None
    except Exception:
        return None


def abort_one(pg: Any) -> None:
    fn = getattr(pg, "abort", None)
    if callable(fn):
        fn()
        return
    for dev in ("cuda", "cpu"):  # torch without ProcessGroup.abort: abort the device backend
        try:
            backend = pg._get_backend(torch.device(dev))
        except Exception:
            continue
        if callable(getattr(backend, "abort", None)):
            backend.abort()
            return
    raise RuntimeError(
        f"this torch ({torch.__version__}) offers no abort for {type(pg).__name__}; peers blocked in a collective "
        f"wait for the process group's timeout"
    )


def abort_groups(groups: list[Any]) -> tuple[list[str], list[str]]:
    """Abort each group; returns (aborted, errors). Several NCCL communicators are aborted inside one NCCL group
    (as torch's _abort_process_group does), so that aborting one cannot deadlock on another's pending kernel."""
    aborted: list[str] = []
    errors: list[str] = []
    nccl = nccl_backend() if len(groups) > 1 else None
    if nccl is not None:
        try:
            nccl._group_start()
        except Exception:
            nccl = None
    try:
        for pg in groups:
            name = group_name(pg)
            try:
                abort_one(pg)
                aborted.append(name)
            except Exception as e:
                errors.append(f"{name}: {type(e).__name__}: {e}")
                log.warning("could not abort process group %s: %s", name, e)
    finally:
        if nccl is not None:
            try:
                nccl._group_end()
            except Exception as e:
                errors.append(f"ncclGroupEnd: {type(e).__name__}: {e}")
    return aborted, errors


def group_name(pg: Any) -> str:
    try:
        return str(pg.group_name)
    except Exception:
        return repr(pg)
