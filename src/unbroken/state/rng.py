"""The process-global random number generators, captured and restored as one unit.

Covered: python ``random``, numpy's legacy global generator, torch CPU, and every
CUDA device when CUDA is available. Restore this *last*, after everything else in
the state has been loaded, so that nothing the restore does (building optimizer
state, creating tensors) draws from a generator after it was set.
"""

from __future__ import annotations

import random
import warnings
from typing import Any

import numpy as np
import torch


class GlobalRNG:
    """``Stateful`` wrapper around the global RNGs of this process."""

    def state_dict(self) -> dict[str, Any]:
        state: dict[str, Any] = {
            "python": random.getstate(),
            "numpy": np.random.get_state(legacy=False),
            "torch": torch.get_rng_state(),
        }
        if torch.cuda.is_available():
            state["cuda"] = torch.cuda.get_rng_state_all()
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        py = state["python"]
        random.setstate((py[0], tuple(py[1]), py[2]))
        np.random.set_state(state["numpy"])
        torch.set_rng_state(state["torch"].cpu())
        cuda = state.get("cuda")
        if cuda:
            if not torch.cuda.is_available():
                warnings.warn(
                    "the checkpoint holds CUDA RNG states but CUDA is not available here; "
                    "GPU random streams are not restored",
                    stacklevel=3,
                )
            elif len(cuda) != torch.cuda.device_count():
                warnings.warn(
                    f"the checkpoint holds {len(cuda)} CUDA RNG states but {torch.cuda.device_count()} "
                    "devices are visible; restoring the common ones only",
                    stacklevel=3,
                )
                for i, s in enumerate(cuda[: torch.cuda.device_count()]):
                    torch.cuda.set_rng_state(s.cpu(), i)
            else:
                torch.cuda.set_rng_state_all([s.cpu() for s in cuda])
