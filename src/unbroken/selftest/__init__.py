"""``unbroken selftest``: prove that a user's own training script resumes exactly.

The command runs the unmodified script twice in run folders it owns: once uninterrupted,
once interrupted several times (SIGKILL after a step or inside a save, SIGTERM, an
exception) and resumed each time. While it runs, the script's :class:`~unbroken.Checkpointer`
records a compact fingerprint of the state at every optimizer step; the two runs'
fingerprints are compared and the first diverging step and component is diagnosed.

One concept per module:

- :mod:`.protocol`: the environment variables between the command and the script's Checkpointer;
- :mod:`.fingerprint`: cheap hashes of tensors, state objects, RNG streams;
- :mod:`.hooks`: the recorder inside the script's process (installed only in selftest mode);
- :mod:`.variables`: the loop's plain variables, hashed (evidence of a value carried outside the state);
- :mod:`.lines`: which lines of the script ran (the uninterrupted run);
- :mod:`.plan`: where and how the interrupted run is interrupted (random, plus targeted places);
- :mod:`.runner`: one attempt: spawn, time out, clean up the process group;
- :mod:`.compare`: align the two runs' records, find the first difference in what the training consumes;
- :mod:`.evidence`: the facts around a difference that a diagnosis must agree with;
- :mod:`.diagnose`: which components differ -> the cause in plain words, and the fix (or "cannot tell");
- :mod:`.coverage`: what the selftest did not cover, and notes on what it set aside;
- :mod:`.session`: the whole selftest, from command to verdict;
- :mod:`.workdir`: the work folder a tool owns (also the demo's): taken only if new, empty or marked.

Outside selftest mode none of this is imported by a training process beyond
:mod:`.protocol` (one environment lookup per Checkpointer, one attribute check per step).
"""
