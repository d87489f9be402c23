"""The arena (tripwire._runtime.arena) behind a Monitor: a lost reader's arena is kept for the process's lifetime
(a kernel may still write it), and an unindexed ``"cuda"`` is never cached as it is (it names whichever device is
current at the call)."""

from __future__ import annotations

import logging

import pytest
import torch

from tripwire import GuardTripped
from tripwire._runtime.arena import is_kept, unindexed_cuda


def test_reader_loss_arms_and_keeps_the_buffer(registry, monitor, caplog):
    caplog.set_level(logging.INFO, logger="tripwire")
    s = registry.register("k.site")
    ctr = monitor.counter(s, "cpu")
    arena = monitor.arena.get(torch.device("cpu"))
    reader = monitor.readers()["cpu"]

    def broken(n):
        raise RuntimeError("device fell off the bus")

    reader.poll = broken
    monitor.poll()
    assert reader.lost is not None
    with pytest.raises(GuardTripped, match="lost the reader of cpu"):
        monitor.check()
    assert is_kept(arena)  # kept alive forever
    assert monitor.counter(s, "cpu").data_ptr() == ctr.data_ptr() == arena[s.id].data_ptr()
    monitor.poll()  # no longer polled: no second error
    assert sum("failed" in r.getMessage() for r in caplog.records if r.levelno == logging.ERROR) == 1


def test_unindexed_cuda_is_never_cached_as_is():
    assert unindexed_cuda("cuda") and unindexed_cuda(torch.device("cuda"))
    assert not unindexed_cuda("cuda:0") and not unindexed_cuda("cpu") and not unindexed_cuda(0)
