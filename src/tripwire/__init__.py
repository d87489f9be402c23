"""tripwire: masked, counted, reported faults for GPU kernels, safe under CUDA-graph capture.

Importing tripwire reads no setting, initialises no CUDA context, starts no thread and allocates no device memory
(``tests/test_import.py`` proves it). The default monitor is built on first use.

Triton device helpers live in :mod:`tripwire.triton` (CUDA C++ ones in the header under :func:`include_dir`);
reference guarded kernels in :mod:`tripwire.kernels`; numeric instruments in :mod:`tripwire.numerics`; several ranks
in :mod:`tripwire.distributed`; events and their sinks (JSON lines, Prometheus) in :mod:`tripwire.sinks`; metadata
validators in :mod:`tripwire.validate`; engine integrations in :mod:`tripwire.integrations`.
"""

from __future__ import annotations

from ._runtime.default import (
    check,
    configure,
    counter,
    default_monitor,
    drain,
    health,
    poll,
    prealloc,
    register_post_capture_hook,
    reset,
    run_post_capture_hooks,
    snapshot,
    start,
    stop,
)
from .config import MODES, Settings, load_settings
from .contain import Taint
from .errors import CaptureError, GuardTripped
from .include import include_dir
from .layout import GUARD_BIAS, SLOTS, decode, decode_neg, encode, encode_neg
from .monitor import Hit, Monitor
from .sinks import Event, Offender
from .sites import Site, SiteRegistry, register_site, sites
from .verdict import Verdict, Verdicts

__version__ = "0.3.0"

__all__ = [
    # sites
    "Site",
    "SiteRegistry",
    "register_site",
    "sites",
    # arena and lifecycle
    "prealloc",
    "counter",
    "start",
    "check",
    "drain",
    "stop",
    "register_post_capture_hook",
    "run_post_capture_hooks",
    # tools
    "snapshot",
    "reset",
    "poll",
    "health",
    "Hit",
    # events (tripwire.sinks has the sinks), offenders, containment and same-step verdicts (Monitor.verdicts)
    "Event",
    "Offender",
    "Taint",
    "Verdict",
    "Verdicts",
    # monitor and settings
    "Monitor",
    "default_monitor",
    "configure",
    "Settings",
    "load_settings",
    "MODES",
    # errors
    "GuardTripped",
    "CaptureError",
    # CUDA C++ helpers (tripwire/guard.cuh)
    "include_dir",
    # counter encoding
    "GUARD_BIAS",
    "SLOTS",
    "encode",
    "encode_neg",
    "decode",
    "decode_neg",
    "__version__",
]
