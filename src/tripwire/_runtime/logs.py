"""The ``tripwire`` logger's one handler: Python's last resort, with the level and the logger's name.

Every line tripwire logs goes through the ``tripwire`` logger (or a child), and no message starts with
"tripwire:": the logger's name says whose line it is, in any format that shows the name (``%(name)s``), so a prefix
would be said twice there. An application that configured no logging at all (a bare script, and vLLM's processes:
vLLM configures its own ``vllm`` logger only) gets Python's last-resort handler, which prints the bare message: a
line like "lost the reader of cuda:0" would then not say whose it is. :class:`Fallback` stands in for the last
resort on the ``tripwire`` logger alone: at WARNING and above, to stderr, as ``LEVEL tripwire: message``, and only
while no other handler would take the record, so that it never doubles a line an application's own handler shows.
"""

from __future__ import annotations

import logging
import sys

FORMAT = "%(levelname)s %(name)s: %(message)s"


class Fallback(logging.Handler):
    """Writes a record to stderr (the one current at the call, as the last resort does) only when no other handler
    on its logger's way to the root would get it: the last resort's rule, with the logger's name shown."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.setFormatter(logging.Formatter(FORMAT))

    def handled_elsewhere(self, record: logging.LogRecord) -> bool:
        """Whether a handler other than this one sits on the record's logger or an ancestor it propagates to
        (counted whatever its level, exactly as :mod:`logging` decides whether the last resort runs)."""
        logger: logging.Logger | None = logging.getLogger(record.name)
        while logger is not None:
            if any(h is not self for h in logger.handlers):
                return True
            if not logger.propagate:
                return False
            logger = logger.parent  # type: ignore[assignment]
        return False

    def emit(self, record: logging.LogRecord) -> None:
        if self.handled_elsewhere(record):
            return
        stream = sys.stderr
        if stream is None:  # pythonw, or stderr closed: nowhere to write, as for the last resort
            return
        try:
            stream.write(self.format(record) + "\n")
            stream.flush()
        except Exception:
            self.handleError(record)


def install(logger: logging.Logger | None = None) -> Fallback:
    """Give ``logger`` (default: ``tripwire``) its :class:`Fallback`, once; returns the one it has."""
    logger = logging.getLogger("tripwire") if logger is None else logger
    for h in logger.handlers:
        if isinstance(h, Fallback):
            return h
    h = Fallback()
    logger.addHandler(h)
    return h
