"""Sites: named, guarded places in kernels, each owning one row of every device's counter arena.

A site's ``id`` is its row. Rows are handed out in registration order and never reused, so a site registered after
the arena was allocated (and after graphs were captured) still finds its row without moving the tensor. Numeric
instruments register rows here too, under another ``kind``, so one copy per device reads everything.
"""

from __future__ import annotations

import os
import threading
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field

__all__ = ["GUARD_KINDS", "Site", "SiteRegistry", "default_registry", "register_site", "sites"]

# Kinds whose rows use the guard slot layout (count, extremes, first offender). Instruments with other layouts
# (the FP8 clip counter) register their own kind and their own reporter.
GUARD_KINDS = frozenset({"guard", "nonfinite", "nonfinite_rows"})


@dataclass(frozen=True)
class Site:
    """One guarded place. ``id`` is the arena row; ``fatal`` means a hit arms the stop in every mode but off."""

    id: int
    name: str
    description: str = ""
    fatal: bool = False
    kind: str = "guard"
    registry: SiteRegistry = field(repr=False, compare=False, default=None)  # type: ignore[assignment]


class SiteRegistry:
    """A thread-safe name -> :class:`Site` table with fixed capacity.

    ``capacity`` is the number of rows every arena built for this registry will have; registering past it raises,
    rather than handing out a row that no arena holds. The default registry takes ``TRIPWIRE_CAPACITY``.
    """

    def __init__(self, capacity: int | None = None) -> None:
        self._lock = threading.Lock()
        self._by_name: dict[str, Site] = {}
        self._by_id: list[Site] = []
        self._capacity = capacity
        # Called with the new size after each registration (monitors' native ticks copy the new row from then on).
        # Weak: a registry outlives the many monitors tests build on it.
        self._listeners: list[weakref.WeakMethod[Callable[[int], None]]] = []

    def add_listener(self, method: Callable[[int], None]) -> None:
        """Call the bound ``method(n_sites)`` after every new registration, for as long as its object lives."""
        with self._lock:
            self._listeners = [w for w in self._listeners if w() is not None]
            self._listeners.append(weakref.WeakMethod(method))  # type: ignore[arg-type]

    @property
    def capacity(self) -> int:
        if self._capacity is None:
            # Read lazily (not at import) and validated like every setting: a broken value raises here.
            from .config import load_settings

            self._capacity = load_settings({k: v for k, v in os.environ.items() if k == "TRIPWIRE_CAPACITY"}).capacity
        return self._capacity

    def register(self, name: str, *, description: str = "", fatal: bool = False, kind: str = "guard") -> Site:
        if not isinstance(name, str) or not name.strip():
            raise ValueError(f"a site name must be a non-empty string, got {name!r}")
        if not isinstance(description, str):
            raise TypeError(f"description must be a str, got {type(description).__name__}")
        if not isinstance(fatal, bool):
            raise TypeError(f"fatal must be a bool, got {type(fatal).__name__}")
        if not isinstance(kind, str) or not kind:
            raise ValueError(f"kind must be a non-empty string, got {kind!r}")
        with self._lock:
            old = self._by_name.get(name)
            if old is not None:
                if (old.description, old.fatal, old.kind) != (description, fatal, kind):
                    raise ValueError(
                        f"site {name!r} is already registered with description={old.description!r}, "
                        f"fatal={old.fatal}, kind={old.kind!r}; re-registering it with description={description!r}, "
                        f"fatal={fatal}, kind={kind!r} would make two kernels disagree about what its counts mean"
                    )
                return old
            row = len(self._by_id)
            if row >= self.capacity:
                raise ValueError(
                    f"cannot register site {name!r}: the arena capacity of {self.capacity} rows is used up "
                    f"(raise TRIPWIRE_CAPACITY before the first registration)"
                )
            site = Site(id=row, name=name, description=description, fatal=fatal, kind=kind, registry=self)
            self._by_name[name] = site
            self._by_id.append(site)
            listeners = list(self._listeners)
        for w in listeners:  # outside the lock: a listener may read the registry
            fn = w()
            if fn is not None:
                fn(len(self._by_id))  # the size now, not this row's: registrations may race
        return site

    def get(self, name: str) -> Site:
        with self._lock:
            try:
                return self._by_name[name]
            except KeyError:
                raise KeyError(f"no site named {name!r} is registered") from None

    def by_id(self, site_id: int) -> Site:
        sites = self._by_id  # list append is atomic under the GIL; a read needs no lock
        if not isinstance(site_id, int) or not 0 <= site_id < len(sites):
            raise KeyError(f"no site with id {site_id!r} in this registry ({len(sites)} registered)")
        return sites[site_id]

    def resolve(self, site: Site | str | int) -> Site:
        """The registered site for ``site`` (a Site, a name or an id); a Site of another registry is refused."""
        if isinstance(site, Site):
            if site.registry is not self or site.id >= len(self._by_id) or self._by_id[site.id] is not site:
                raise ValueError(f"site {site.name!r} (id {site.id}) belongs to another registry")
            return site
        if isinstance(site, str):
            return self.get(site)
        if isinstance(site, int) and not isinstance(site, bool):
            return self.by_id(site)
        raise TypeError(f"expected a Site, a site name or an id, got {type(site).__name__}")

    def __len__(self) -> int:
        return len(self._by_id)

    def all(self) -> list[Site]:
        with self._lock:
            return list(self._by_id)


_DEFAULT = SiteRegistry()


def default_registry() -> SiteRegistry:
    return _DEFAULT


def register_site(name: str, *, description: str = "", fatal: bool = False) -> Site:
    """Register (or look up) a guard site in the default registry.

    Registering the same name with the same attributes returns the same :class:`Site`; with different attributes
    it raises ValueError. Call it at import time of the module that owns the kernel, so the row exists before any
    capture. It allocates nothing on any device.
    """
    return _DEFAULT.register(name, description=description, fatal=fatal)


def sites() -> list[Site]:
    """Every site and instrument row registered in the default registry, in row order."""
    return _DEFAULT.all()
