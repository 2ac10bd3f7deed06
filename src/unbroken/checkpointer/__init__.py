"""The training side (layer 4): what each :class:`~unbroken.Checkpointer` call does.

``manager`` (the Checkpointer: the public methods, as short delegations) over its parts, each handed the
``core`` they share: ``saving`` (the save path), ``stepping`` (the step boundary, with ``agreement``: what
the ranks decide at a step), ``restoring`` (the restore path: choose, check, load, RNGs last),
``lifecycle`` (its time as the run's writer). Beside them: ``saved_state`` (what a checkpoint holds, and
the checks on a state), ``epochs`` (the epoch boundary), ``environment`` (the fingerprint and
``EnvCheck``) and ``probe`` (numbers recomputed after a restore)."""
