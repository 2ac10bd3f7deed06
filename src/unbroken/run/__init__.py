"""A run folder over time (layer 3): ``run`` (the stores of every tier, the writer lock, commit order),
``collective`` (saving and choosing with every rank: one protocol for 1 and N processes), ``choosing``
(the newest valid checkpoint across tiers), ``damage`` (quarantine, and what could not be restored),
``scheduling`` (when to save, what to keep), ``pruning`` (retention applied) and ``index/`` (the run
index: every save, restart and metric)."""
