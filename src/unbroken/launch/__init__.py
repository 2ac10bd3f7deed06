"""``unbroken run``: restart a training process after a failure, from a warm spare (:mod:`.supervisor`).

- :mod:`.command`: which commands a spare can become (``python [flags] script`` or ``-m module``);
- :mod:`.spare`: the waiting interpreter;
- :mod:`.supervisor`: the restart loop, the signals, the exit status.
"""
