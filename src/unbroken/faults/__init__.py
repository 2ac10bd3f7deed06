"""Preemption and failure handling: signals, exact emergency saves, SLURM.

- :mod:`.signals` — handlers that only set a flag; the save happens at the next step
  boundary on the main thread.
- :mod:`.guard` — ``Checkpointer.guard(state)``: an exception inside a step gives an
  exact emergency checkpoint, then propagates.
- :mod:`.slurm` — SLURM detection, requeue, and a ``submit.slurm`` that resubmits the job.
"""

EXIT_PREEMPTED = 75
"""Exit status after a signal-triggered save (``EX_TEMPFAIL``: "try again later").

Non-zero so that ``torchrun --max-restarts`` and job schedulers see an unfinished run;
distinct from crashes (1) and from death by signal (128 + n)."""
