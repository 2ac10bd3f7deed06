"""The run index (``.unbroken/index.sqlite``): ``index`` (what a run did: saves, restarts, metrics),
``indexfile`` (its SQLite file, written atomically), ``recorder`` (the plug-in that writes it from the
events), ``continuity`` (metrics that continue across a resume) and ``plotting`` (a run's curves)."""
