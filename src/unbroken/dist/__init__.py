"""Several processes, one run: who coordinates, how ranks agree, and sharded tensors.

- :mod:`.comm` — this process's rank and world size (the one lookup) and the few
  collectives the run needs (broadcast, all-gather, any), on a private gloo group with a
  timeout, pickle-free; a no-op at world size 1.
- :mod:`.rendezvous` — a store prefix the ranks of this round agree on through the store,
  so that groups created after a torchrun restart never read the previous round's keys.
- :mod:`.sharded` — DTensor / FSDP2 state saved and loaded through
  ``torch.distributed.checkpoint`` planners into the run's own files (resharding at load).
"""
