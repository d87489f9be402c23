"""tripwire's exceptions."""

from __future__ import annotations

__all__ = ["CaptureError", "GuardTripped", "SettingError"]


class CaptureError(RuntimeError):
    """Raised instead of doing something that would break (or silently corrupt) a CUDA-graph capture.

    Examples: allocating the counter arena, or creating the reader's pinned mirror, while the current stream is
    capturing. The exception is raised *before* any CUDA call, so the capture in progress stays usable.
    """


class SettingError(ValueError):
    """A ``TRIPWIRE_*`` variable or a setting keyword that is set but broken (a bad value, or a name tripwire does
    not read). The message names the variable and what is wrong with it; the ``tripwire`` command prints it as one
    line and exits 2."""


class GuardTripped(RuntimeError):
    """The armed stop: a guarded kernel masked a fault that must not be ignored.

    Raised by :func:`tripwire.check` on the engine thread. It is *late*: the reader confirms a hit over two
    copies, so the raise comes up to about two reader intervals (plus one step) after the kernel ran. It is *local*
    to its process unless :func:`tripwire.distributed.coordinate` is used, in which case a peer's stop arrives
    with ``rank`` set to the rank that fired.

    Attributes: ``site`` (name), ``device`` (``"cuda:0"``, ``"cpu"``), ``count`` (hits at confirmation),
    ``first_row``/``first_value`` (the first offender pair the kernel recorded, or ``None``), ``rank`` (``None``
    when the hit was local), ``fatal`` (the site was registered fatal).
    """

    def __init__(
        self,
        message: str,
        *,
        site: str,
        device: str,
        count: int,
        first_row: int | None = None,
        first_value: int | None = None,
        rank: int | None = None,
        fatal: bool = False,
    ) -> None:
        super().__init__(message)
        self.site = site
        self.device = device
        self.count = count
        self.first_row = first_row
        self.first_value = first_value
        self.rank = rank
        self.fatal = fatal

    @classmethod
    def internal(cls, message: str, device: str = "*") -> GuardTripped:
        """A stop armed by tripwire itself (a lost reader, a failed reader loop), not by a site's hit."""
        return cls(message, site="<reader>", device=device, count=0)

    def as_dict(self) -> dict[str, object]:
        """The stop as plain JSON types (``Monitor.health()``)."""
        return {
            "site": self.site,
            "device": self.device,
            "rank": self.rank,
            "count": self.count,
            "first_row": self.first_row,
            "first_value": self.first_value,
            "fatal": self.fatal,
            "message": str(self),
        }

    def __reduce__(self):  # picklable, so it can cross process boundaries in tests and tools
        return (
            _rebuild_guard_tripped,
            (str(self), self.site, self.device, self.count, self.first_row, self.first_value, self.rank, self.fatal),
        )


def _rebuild_guard_tripped(message, site, device, count, first_row, first_value, rank, fatal):  # type: ignore[no-untyped-def]
    return GuardTripped(
        message,
        site=site,
        device=device,
        count=count,
        first_row=first_row,
        first_value=first_value,
        rank=rank,
        fatal=fatal,
    )
