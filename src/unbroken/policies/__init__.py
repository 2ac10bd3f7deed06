"""When to save (triggers) and what to keep (retention): tiny composable rules.

A **trigger** decides at a step boundary whether a save is due from a frozen
:class:`TriggerContext` alone (``now`` included: testable with made-up times); ``|``
combines triggers (:class:`AnyOf`). One with memory (:class:`OnImprovement`'s best)
has ``state_dict``/``load_state_dict``, so a resumed run does not save on its first value.

A **retention** rule names the checkpoints to keep; ``|`` combines rules (:class:`Union`).
:func:`to_delete` never deletes the newest checkpoint nor a ``protect``-ed one (just
committed, being written), and decides from the committed checkpoints alone, so a run
killed between a commit and its pruning loses nothing: the next pruning does both rounds.

Metrics may be numbers, 0-d tensors, numpy scalars, or the ``"nan"``/``"inf"``/``"-inf"``
strings manifests store for non-finite floats. NaN never improves and is never "best".

``save_every="auto"`` is :class:`AutoInterval`: the interval that loses the least time, from the
blocking time of this run's saves and its failures (:mod:`unbroken.policies.interval`).

Modules: :mod:`.triggers`, :mod:`.interval`, :mod:`.retention`; every name is importable from here.
"""

from .interval import AutoInterval
from .retention import (
    CheckpointMeta,
    KeepAll,
    KeepBest,
    KeepEveryNSteps,
    KeepLast,
    KeepTagged,
    Retention,
    Union,
    to_delete,
)
from .triggers import (
    AnyOf,
    AtEpochEnd,
    EveryMinutes,
    EveryNSteps,
    Mode,
    OnImprovement,
    Trigger,
    TriggerContext,
    metric_value,
)

__all__ = ["TriggerContext", "Trigger", "EveryNSteps", "EveryMinutes", "AutoInterval", "AtEpochEnd", "OnImprovement",
           "AnyOf", "CheckpointMeta", "Retention", "KeepLast", "KeepBest", "KeepEveryNSteps", "KeepTagged", "KeepAll",
           "Union", "to_delete", "metric_value", "Mode"]
