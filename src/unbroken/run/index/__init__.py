"""The run index (``.unbroken/index.sqlite``): ``index`` (what a run did: saves, restarts, metrics),
``schema`` (its tables), ``indexfile`` (its SQLite file, written atomically), ``recorder`` (the plug-in
that writes it from the events), ``progress`` (how far each segment got, what its saves blocked),
``continuity`` (metrics that continue across a resume), ``plotting`` (a run's curves) and ``goodput``
(where a run's time went, and its picture: ``goodplot``)."""
