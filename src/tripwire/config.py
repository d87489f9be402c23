"""Settings: ``TRIPWIRE_*`` environment variables and the same names as keyword arguments.

Validation fails closed. A setting that is present but broken (an unknown mode, ``nan``, ``0``, ``-1``, ``abc``, an
empty string) raises ``ValueError`` naming the variable and the value: a typo must never silently disarm the
instrument by falling back to a default. Only an *absent* variable takes the default. A ``TRIPWIRE_*`` name that
tripwire does not read (``TRIPWIRE_MDOE``) is refused the same way, with the known name it is closest to: a
misspelt name would otherwise leave its setting at the default without a word. The errors are
:class:`tripwire.errors.SettingError`, a ``ValueError``.
"""

from __future__ import annotations

import difflib
import math
import os
from collections.abc import Mapping
from dataclasses import dataclass, fields, replace
from typing import Any

from .errors import SettingError

__all__ = [
    "MODES",
    "NATIVE_TICK",
    "OTHER_VARIABLES",
    "SettingError",
    "SettingView",
    "Settings",
    "check_timeout",
    "check_variable_names",
    "known_variables",
    "load_settings",
]

MODES = ("raise", "warn", "off")

# name -> (environment variable, default)
_ENV = {
    "mode": ("TRIPWIRE_MODE", "warn"),
    "interval": ("TRIPWIRE_INTERVAL", 0.05),
    "idle_tail": ("TRIPWIRE_IDLE_TAIL", 2.0),
    "report_every": ("TRIPWIRE_REPORT_EVERY", 10.0),
    "capacity": ("TRIPWIRE_CAPACITY", 1024),
    "offenders": ("TRIPWIRE_OFFENDERS", 8),
    "heartbeat": ("TRIPWIRE_HEARTBEAT", 60.0),
    "native_tick": ("TRIPWIRE_NATIVE_TICK", "auto"),
    "event_log": ("TRIPWIRE_EVENT_LOG", None),
    "store_poll": ("TRIPWIRE_STORE_POLL", 0.5),
    "contain": ("TRIPWIRE_CONTAIN", False),
}
NATIVE_TICK = ("auto", "on", "off")

# The TRIPWIRE_* variables read outside Settings, by the integrations, the tools and CI. Every name the package, its
# tests, benchmarks and CI read is here or in _ENV (tests/test_config.py greps the tree for them).
OTHER_VARIABLES = {
    "TRIPWIRE_VLLM": "the vLLM plugin's mode (tripwire.integrations.vllm)",
    "TRIPWIRE_VLLM_LOGITS": "the vLLM plugin's per-request NaN/Inf check of the step's logits (on unless 0/off)",
    "TRIPWIRE_VLLM_METRICS_DIR": "the folder through which the vLLM plugin's processes hand their metrics to the API "
    "server's /metrics (made by the plugin in the first vLLM process, inherited by the others)",
    "TRIPWIRE_VLLM_PYTHON": "the python of the vLLM environment (tripwire demo --engine vllm, the vLLM tests)",
    "TRIPWIRE_VLLM_FAULTS": "the faults the vLLM demo and tests inject into the engine (a JSON list)",
    "TRIPWIRE_VLLM_FAULTS_LOG": "where the vLLM fault injection logs what it injected",
    "TRIPWIRE_VLLM_FAULTS_NO_EVICT": "the vLLM tests' control: containment keeps a failed request's cached blocks",
    "TRIPWIRE_VLLM_VENV": "where CI (.ci/run) makes the vLLM environment",
    "TRIPWIRE_VLLM027_VENV": "where CI (.ci/run) makes the environment of vLLM's oldest CPU build in the range (0.27)",
    "TRIPWIRE_VLLM_SOURCE_CACHE": "where the vLLM source checks cache the files they read from the registry's wheels",
}


def known_variables() -> tuple[str, ...]:
    """Every ``TRIPWIRE_*`` name tripwire reads, sorted: the settings' and :data:`OTHER_VARIABLES`."""
    return tuple(sorted({var for var, _ in _ENV.values()} | set(OTHER_VARIABLES)))


def check_variable_names(env: Mapping[str, str] | None = None) -> None:
    """:class:`SettingError` naming each ``TRIPWIRE_*`` name in ``env`` (default ``os.environ``) that tripwire does
    not read, with the known name closest to it."""
    env = os.environ if env is None else env
    known = known_variables()
    unknown = sorted(k for k in env if k.startswith("TRIPWIRE_") and k not in known)
    if not unknown:
        return
    parts = []
    for name in unknown:
        # Compared after the prefix, which every name shares (it would make any name look close to a short one).
        close = difflib.get_close_matches(name[9:], [k[9:] for k in known], n=1, cutoff=0.6)
        parts.append(f"{name} is not a tripwire setting" + (f" (did you mean TRIPWIRE_{close[0]}?)" if close else ""))
    raise SettingError(f"{'; '.join(parts)}; tripwire reads {', '.join(known)} (unset any other TRIPWIRE_* name)")


def _parse_mode(var: str, raw: Any) -> str:
    if not isinstance(raw, str):
        raise SettingError(f"{var}={raw!r}: the mode must be a string, one of {', '.join(MODES)}")
    mode = raw.strip().lower()
    if mode not in MODES:
        raise SettingError(f"{var}={raw!r} is not a mode; expected one of {', '.join(MODES)}")
    return mode


def _parse_native_tick(var: str, raw: Any) -> str:
    if not isinstance(raw, str) or raw.strip().lower() not in NATIVE_TICK:
        raise SettingError(f"{var}={raw!r} is not a native-tick choice; expected one of {', '.join(NATIVE_TICK)}")
    return raw.strip().lower()


_TRUE, _FALSE = ("1", "true", "yes", "on"), ("0", "false", "no", "off")


def _parse_switch(var: str, raw: Any) -> bool:
    if isinstance(raw, bool):
        return raw
    text = raw.strip().lower() if isinstance(raw, str) else None
    if text in _TRUE:
        return True
    if text in _FALSE:
        return False
    raise SettingError(f"{var}={raw!r} is not a switch; expected one of {', '.join(_TRUE + _FALSE)}")


def _parse_path(var: str, raw: Any) -> str | None:
    """A file path, or None (no file). Whether it can be written is checked where it is opened (the monitor's
    construction), so that an unwritable path fails there too."""
    if raw is None:
        return None
    if isinstance(raw, os.PathLike):
        raw = os.fspath(raw)
    if not isinstance(raw, str) or not raw.strip():
        raise SettingError(f"{var}={raw!r}: expected a file path (unset it for no event log)")
    return raw


def _parse_seconds(var: str, raw: Any) -> float:
    if isinstance(raw, bool):
        raise SettingError(f"{var}={raw!r}: expected a positive number of seconds, got a bool")
    try:
        value = float(raw.strip()) if isinstance(raw, str) else float(raw)
    except (TypeError, ValueError):
        raise SettingError(f"{var}={raw!r} is not a number of seconds") from None
    if not math.isfinite(value) or value <= 0:
        raise SettingError(f"{var}={raw!r}: expected a finite number of seconds > 0")
    return value


def _parse_count(var: str, raw: Any, what: str, most: int, why: str) -> int:
    if isinstance(raw, bool):
        raise SettingError(f"{var}={raw!r}: expected a positive whole number of {what}, got a bool")
    if isinstance(raw, int):
        value = raw
    else:
        text = raw.strip() if isinstance(raw, str) else raw
        try:
            value = int(text)
        except (TypeError, ValueError):
            raise SettingError(f"{var}={raw!r} is not a whole number of {what}") from None
    if value <= 0:
        raise SettingError(f"{var}={raw!r}: expected a whole number of {what} > 0")
    if value > most:
        raise SettingError(f"{var}={raw!r}: more than {most} {what} is {why}")
    return value


def _parse_capacity(var: str, raw: Any) -> int:
    return _parse_count(var, raw, "rows", 1 << 20, "not a counter arena but a mistake")


def _parse_offenders(var: str, raw: Any) -> int:
    # Each is kept per row on every device and read when a count rises: a handful, not a log.
    return _parse_count(var, raw, "offenders", 256, "not a per-row list but a log (use a sink for that)")


_PARSERS = {
    "mode": _parse_mode,
    "interval": _parse_seconds,
    "idle_tail": _parse_seconds,
    "report_every": _parse_seconds,
    "heartbeat": _parse_seconds,
    "capacity": _parse_capacity,
    "offenders": _parse_offenders,
    "native_tick": _parse_native_tick,
    "event_log": _parse_path,
    "store_poll": _parse_seconds,
    "contain": _parse_switch,
}


@dataclass(frozen=True)
class Settings:
    """Validated settings of one :class:`tripwire.Monitor` (each is a ``TRIPWIRE_*`` variable and the same keyword).

    * ``mode``: ``raise`` (any hit arms the stop), ``warn`` (report; fatal sites arm) or ``off`` (no reader at all).
    * ``interval``: seconds between reader ticks.
    * ``idle_tail``: seconds without a ``check()`` after which the reader stops copying.
    * ``report_every``: the least seconds between two WARNING lines of one site.
    * ``capacity``: rows per device arena, fixed for the process.
    * ``offenders``: distinct offenders kept per row on the device (row, value, request), fixed with the arena.
    * ``heartbeat``: seconds between the numeric instruments' INFO heartbeats.
    * ``native_tick``: ``auto`` (default: quiet ticks run on a small native thread that never takes the GIL, when it
      can be built here; else Python ticks them, with one WARNING saying why), ``on`` (``start()`` raises if it
      cannot be built), ``off`` (every tick in Python, holding the engine's GIL for the whole tick).
    * ``event_log``: a file that gets one JSON line per event (:class:`tripwire.sinks.JsonLines`), or None.
    * ``store_poll``: seconds between :func:`tripwire.distributed.coordinate`'s polls of the job's store, on its own
      thread (the reader's ticks stay native): how late a peer's stop arrives, against the store's load (one request
      per rank per poll).
    * ``contain``: containment (:mod:`tripwire.contain`): a same-step verdict's attributed masked fault fails the
      requests it hit instead of arming the stop; off by default, switched on only explicitly (this setting, or
      :meth:`tripwire.Monitor.set_contain`, which an integration's ``install(contain=True)`` calls).
    """

    mode: str = "warn"
    interval: float = 0.05
    idle_tail: float = 2.0
    report_every: float = 10.0
    capacity: int = 1024
    offenders: int = 8
    heartbeat: float = 60.0
    native_tick: str = "auto"
    event_log: str | None = None
    store_poll: float = 0.5
    contain: bool = False

    def __post_init__(self) -> None:
        # Validate keyword-built settings exactly like environment ones: the same fail-closed rules.
        for f in fields(self):
            var = _ENV[f.name][0]
            object.__setattr__(self, f.name, _PARSERS[f.name](f"{f.name} ({var})", getattr(self, f.name)))

    def with_overrides(self, **overrides: Any) -> Settings:
        unknown = set(overrides) - set(_ENV)
        if unknown:
            raise TypeError(f"unknown tripwire setting(s) {sorted(unknown)}; known: {sorted(_ENV)}")
        return replace(self, **{k: v for k, v in overrides.items() if v is not None})


def check_timeout(what: str, timeout: Any) -> None:
    """ValueError unless ``timeout`` is None (no limit) or a finite number of seconds >= 0."""
    if timeout is None:
        return
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not math.isfinite(timeout) or timeout < 0:
        raise ValueError(f"{what}(timeout={timeout!r}): expected None or a finite number of seconds >= 0")


class SettingView:
    """A read-only attribute that shows one of its object's settings: ``Monitor.mode`` is ``monitor.settings.mode``.
    ``setter``: the method that changes this setting on a built object, named by the error an assignment raises
    (None: it is fixed when the object is built)."""

    def __init__(self, setter: str | None = None) -> None:
        self.setter = setter

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name

    def __get__(self, obj: Any, owner: type | None = None) -> Any:
        return self if obj is None else getattr(obj.settings, self.name)

    def __set__(self, obj: Any, value: Any) -> None:
        how = f"call .{self.setter}({value!r})" if self.setter else f"build it with {self.name}=... instead"
        raise AttributeError(f"{type(obj).__name__}.{self.name} is read-only: {how}")


def load_settings(env: Mapping[str, str] | None = None, **overrides: Any) -> Settings:
    """Read the ``TRIPWIRE_*`` variables (``env`` defaults to ``os.environ``), then apply keyword overrides.

    A keyword argument that is not ``None`` wins over its variable. Every value is validated, and every
    ``TRIPWIRE_*`` name in ``env`` must be one tripwire reads (:func:`check_variable_names`); a broken variable
    raises even when a keyword overrides it, because a broken deployment setting is a bug worth hearing about.
    """
    env = os.environ if env is None else env
    unknown = set(overrides) - set(_ENV)
    if unknown:
        raise TypeError(f"unknown tripwire setting(s) {sorted(unknown)}; known: {sorted(_ENV)}")
    check_variable_names(env)
    values: dict[str, Any] = {}
    for name, (var, default) in _ENV.items():
        raw = env.get(var)
        values[name] = default if raw is None else _PARSERS[name](var, raw)  # type: ignore[operator]
    for name, value in overrides.items():
        if value is not None:
            values[name] = _PARSERS[name](name, value)
    return Settings(**values)
