"""Console feedback by default: one concise line per save, resume and fallback on stderr.

unbroken logs through the ``"unbroken"`` logger. If the application has configured logging
(a handler on the root or on that logger), it decides what is shown and nothing is added.
Otherwise the first :class:`~unbroken.Checkpointer` adds a stderr handler at ``INFO`` that
prints ``unbroken: saved ...`` lines, on rank 0 only (other ranks show warnings and errors).
Silence it with ``logging.getLogger("unbroken").setLevel(logging.WARNING)`` or
``UNBROKEN_QUIET=1``.

Whether a run resumed, and from where, is never lost to a logging configuration that was not
about unbroken: a script that configures the root logger at ``WARNING`` (the HF example scripts
do) would drop the ``INFO`` line. :func:`announce` writes such lines through the logger's handlers
anyway (on rank 0), unless the ``"unbroken"`` logger's own level or ``UNBROKEN_QUIET`` says not to.
"""

from __future__ import annotations

import logging
import os
import sys
from typing import Any

_LOGGER = "unbroken"


class _Stderr(logging.StreamHandler):
    """stderr as it is when a record is written (pytest and notebooks swap ``sys.stderr``)."""

    def __init__(self) -> None:
        super().__init__()
        self.setFormatter(logging.Formatter("unbroken: %(message)s"))

    @property
    def stream(self) -> Any:
        return sys.stderr

    @stream.setter
    def stream(self, value: object) -> None:
        pass


def _quiet() -> bool:
    """``UNBROKEN_QUIET`` set, or not rank 0 (the other ranks show warnings and errors only)."""
    return os.environ.get("UNBROKEN_QUIET", "") not in ("", "0") or os.environ.get("RANK", "0") != "0"


def install() -> None:
    """Add the default console handler, unless logging is configured, quiet, or this is not rank 0."""
    logger = logging.getLogger(_LOGGER)
    if logger.handlers or logging.getLogger().handlers or _quiet():
        return
    logger.addHandler(_Stderr())
    if logger.level == logging.NOTSET:
        logger.setLevel(logging.INFO)


def announce(msg: str, *args: Any) -> None:
    """Log ``msg % args`` at ``INFO`` on the ``"unbroken"`` logger, shown even where the logging
    configuration drops ``INFO`` records (see the module docstring): a line the user must see, such as
    where a run resumed from. Silenced only on purpose: a level set on the ``"unbroken"`` logger itself,
    ``UNBROKEN_QUIET``, or a rank other than 0."""
    logger = logging.getLogger(_LOGGER)
    if logger.isEnabledFor(logging.INFO):
        logger.info(msg, *args, stacklevel=2)
        return
    if logger.level != logging.NOTSET or _quiet():
        return
    logger.handle(logger.makeRecord(logger.name, logging.INFO, __file__, 0, msg, args, None))

