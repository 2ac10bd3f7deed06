"""The few exceptions unbroken raises. Each message says what to do next."""

from __future__ import annotations


class UnbrokenError(Exception):
    """Base class of every error raised by unbroken."""


class UnsupportedStateError(UnbrokenError, TypeError):
    """The state holds an object unbroken cannot save without pickle.

    The message names the object's path in the state tree, e.g.
    ``state["optimizer"]["param_groups"][0]["foo"]``, and how to make it savable.
    """


class CorruptCheckpointError(UnbrokenError):
    """A checkpoint failed verification: a file is missing, truncated, altered,
    or the manifest or a tensor header is malformed. Nothing from it was loaded."""


class NoValidCheckpointError(CorruptCheckpointError):
    """The run has checkpoints, but none of them can be restored (each is damaged, or a tier
    that may hold newer ones cannot be read). ``restore`` raises this instead of silently
    starting from step 0; the message names every checkpoint and its damage. Start from scratch
    on purpose with ``restore(state, if_unrestorable="start_fresh")`` (or ``UNBROKEN_START_FRESH=1``)."""


class StateMismatchError(UnbrokenError):
    """The checkpoint does not fit the live state passed to ``restore``/``load``
    (missing or unexpected keys, a Stateful object where a plain value was saved)."""


class CheckpointVanishedError(CorruptCheckpointError):
    """A checkpoint was deleted or moved while it was being read (pruned by the retention of the
    process that writes the run, deleted by ``unbroken prune``, quarantined by another reader):
    its files went missing, but it is not damaged. A subclass of
    :class:`CorruptCheckpointError`, so code that skips a bad checkpoint skips this one too;
    nothing reports it as corrupt or quarantines it. Read the run's newest checkpoint again."""


class NoCheckpointError(UnbrokenError, FileNotFoundError):
    """No checkpoint exists at the given path."""


class NewerFormatError(UnbrokenError):
    """The checkpoint was written by a newer unbroken whose format this version cannot read.

    Not corruption: the checkpoint is left in place, and ``restore`` raises instead of
    silently falling back to an older checkpoint. Upgrade unbroken to load it.
    """


class InsufficientSpaceError(UnbrokenError, OSError):
    """Not enough free space for the next checkpoint; checked before anything is written."""


class RunLockedError(UnbrokenError):
    """Another live process is writing this run folder."""


class EnvironmentMismatchError(UnbrokenError):
    """With ``env_policy="strict"``, the checkpoint was written in a significantly different
    environment (code, versions, config, data or world size). The message lists each
    change; restore that environment, or resume anyway with ``env_policy="warn"``."""


class StorageError(UnbrokenError, OSError):
    """The run location cannot be used: an unknown URL scheme, a backend package that is not
    installed, a bucket that does not exist, credentials that are refused, a server that
    stays unreachable, or a local path that is not a folder. The message says which, and
    what to do."""


class TargetExistsError(UnbrokenError, FileExistsError):
    """A path unbroken was asked to write, empty or replace holds something unbroken did not
    create (a user's file or folder, a link, a checkpoint of a run). Nothing was touched; the
    message says why and what to do (another path, an empty folder, or ``--force`` where offered)."""


class ReadOnlyRunError(StorageError):
    """The run location cannot be written: a read-only filesystem or mount, or a folder this
    user may not write. Reading it works (restore, ``load``, ``unbroken ls``/``verify``);
    saving, pruning and tagging raise this, naming the folder."""


class ConfigurationError(UnbrokenError, ValueError):
    """An argument was refused where it was passed, before anything was created (an uncatchable
    signal in ``Preemption``, a negative grace period, ...). The message names it and what to
    pass instead."""
