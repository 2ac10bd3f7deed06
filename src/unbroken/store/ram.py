"""The RAM tier's store: a :class:`.local.LocalStore` on a tmpfs, with a capacity rule of its own.

Opened by :func:`unbroken.store.open_ram_store` (see :mod:`unbroken.tiers.ram` for the tier). Memory is
bounded by ``keep_last`` checkpoints plus one being written; a save that could not keep that many
is refused before anything is written, with the numbers.
"""

from __future__ import annotations

import os
from pathlib import Path

from ..errors import InsufficientSpaceError
from .local import LocalStore


class RamStore(LocalStore):
    """A run folder in shared memory that holds at most ``keep_last`` checkpoints plus one."""

    def __init__(self, root: str | os.PathLike[str], keep_last: int) -> None:
        super().__init__(Path(root))
        self.keep_last = keep_last
        self._fits = 0  # the largest payload the full rule accepted: smaller ones need only room for themselves

    def used_bytes(self) -> int:
        """Bytes held by the committed checkpoints."""
        total = 0
        for name in self.list_committed():
            try:
                total += sum(f.stat().st_size for f in (self.root / name).iterdir() if f.is_file())
            except OSError:
                continue
        return total

    def check_capacity(self, payload: int) -> None:
        """Refuse a save when ``keep_last + 1`` checkpoints of ``payload`` bytes cannot fit (checked in
        full once per payload size: later saves of that size only need room for themselves)."""
        st = os.statvfs(self.root)
        free, size = st.f_bavail * st.f_frsize, st.f_blocks * st.f_frsize
        if payload <= self._fits and free >= payload:
            return
        need = int((self.keep_last + 1) * payload * 1.01) + (1 << 20)
        mine = self.used_bytes()
        if free + mine < need or free < payload:
            raise InsufficientSpaceError(
                f"the RAM tier in {self.root.parent.parent} cannot hold its checkpoints: it keeps {self.keep_last} "
                f"of about {payload / 1e6:.1f} MB plus one being written, {need / 1e6:.1f} MB in all; the shared "
                f"memory filesystem has {free / 1e6:.1f} MB free of {size / 1e6:.1f} MB ({mine / 1e6:.1f} MB of them "
                "this run's). Give it more (docker run --shm-size=..., or RamTier(root=...) on a bigger tmpfs), "
                "lower RamTier(keep_last=...), or train without the RAM tier. Nothing was written.")
        self._fits = max(self._fits, payload)
