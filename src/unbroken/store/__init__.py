"""Where a run's bytes go: a local folder, S3 or any fsspec filesystem, behind one protocol.

:func:`open_store` is the only way in (:mod:`.open`; :func:`open_ram_store` for a RAM-tier folder);
:mod:`.base` states the protocol and the commit strategies; :mod:`.local` (rename), :mod:`.fsspec` and :mod:`.s3`
(manifest last) implement it, :mod:`.ram` is the RAM tier's local store with its capacity
rule; :mod:`.lock` and :mod:`.lease` keep one writer per run;
:mod:`.retry` retries transient remote errors.
"""

from . import lease as _lease  # noqa: F401 - its exit hook must be registered before the Checkpointer's
from .base import COMMIT_FILE, QUARANTINE, RunLock, Staging, Store
from .open import is_url, open_ram_store, open_store, redact, split_checkpoint

__all__ = ["open_store", "open_ram_store", "split_checkpoint", "is_url", "redact", "Store", "Staging", "RunLock",
           "COMMIT_FILE", "QUARANTINE"]
