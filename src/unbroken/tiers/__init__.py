"""Where else a run's checkpoints live (layer 2): ``remote`` (an upload tier with its own retention:
``Remote``), ``ram`` (node-local shared memory: ``RamTier``), ``ramfolder`` (its folders: owner, locks,
orphans), ``ramwriter`` (the process that persists RAM checkpoints to disk) and ``rampeers`` (copies on
the other nodes, so a lost node's checkpoint survives)."""
