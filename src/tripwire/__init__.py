"""tripwire: masked, counted, reported faults for GPU kernels, safe under CUDA-graph capture.

Importing tripwire reads no setting, initialises no CUDA context, starts no thread and allocates no device memory
(``tests/test_import.py`` proves it). The default monitor is built on first use.

Triton device helpers live in :mod:`tripwire.triton` (CUDA C++ ones in the header under :func:`include_dir`);
reference guarded kernels in :mod:`tripwire.kernels`; numeric instruments in :mod:`tripwire.numerics`; several ranks
in :mod:`tripwire.distributed`; events and their sinks (JSON lines, Prometheus) in :mod:`tripwire.sinks`; the API for
reporters of one's own (and :class:`Offender`) in :mod:`tripwire.report`; metadata validators in
:mod:`tripwire.validate`; engine integrations in :mod:`tripwire.integrations`.
"""

from __future__ import annotations

from ._default import (
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
    snapshot,
    start,
    stop,
)
from ._default import run_post_capture_hooks as run_post_capture_hooks
from ._runtime.logs import install as _install_log_fallback
from .config import MODES
from .config import Settings as Settings
from .config import load_settings as load_settings
from .contain import Taint
from .errors import CaptureError, GuardTripped
from .include import include_dir
from .layout import GUARD_BIAS as GUARD_BIAS
from .layout import SLOTS as SLOTS
from .layout import decode as decode
from .layout import decode_neg as decode_neg
from .layout import encode as encode
from .layout import encode_neg as encode_neg
from .monitor import Hit, Monitor
from .sinks import Event, Offender
from .sites import Site, SiteRegistry, register_site, sites
from .verdict import Verdict, Verdicts

__version__ = "0.4.0"

# Where no logging is configured, tripwire's warnings still say whose they are (tripwire._runtime.logs).
_install_log_fallback()

# What users import. Importable from here too, and left out of it (the ``X as X`` imports above): the counter encoding
# (GUARD_BIAS, SLOTS, encode, decode, ...), the ABI the kernels write, whose one home is tripwire.layout beside
# include/tripwire/guard.cuh; Settings and load_settings (the monitor's settings: tripwire.config); and
# run_post_capture_hooks (what start() runs).
__all__ = [
    # the lifecycle an engine runs (the default monitor's)
    "prealloc",
    "counter",
    "start",
    "check",
    "drain",
    "stop",
    "register_post_capture_hook",
    # sites
    "Site",
    "SiteRegistry",
    "register_site",
    "sites",
    # reading, for tools and tests
    "snapshot",
    "poll",
    "reset",
    "health",
    "Hit",
    # events (tripwire.sinks has the sinks), offenders (tripwire.report has the reporter API), containment and
    # same-step verdicts (Monitor.verdicts)
    "Event",
    "Offender",
    "Taint",
    "Verdict",
    "Verdicts",
    # monitors and settings
    "Monitor",
    "default_monitor",
    "configure",
    "MODES",
    # errors
    "GuardTripped",
    "CaptureError",
    # CUDA C++ helpers (tripwire/guard.cuh)
    "include_dir",
    "__version__",
]
