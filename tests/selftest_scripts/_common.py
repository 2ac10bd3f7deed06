"""Shared pieces of the selftest's test scripts: a fixed dataset and a small model.

Each script next to this one is a complete training loop with unbroken and exactly one
classic mistake (or none); ``tests/test_selftest.py`` runs ``unbroken selftest`` on them.
"""

from __future__ import annotations

import sys

import torch
from torch.utils.data import Dataset

torch.set_num_threads(1)
RUN = sys.argv[1] if len(sys.argv) > 1 else "runs/selftest-script"  # the selftest overrides it anyway
N, FEATURES, BATCH, TOTAL = 512, 16, 8, 1000


class Points(Dataset):
    def __init__(self, n: int = N, seed: int = 0) -> None:
        g = torch.Generator().manual_seed(seed)
        self.x = torch.randn(n, FEATURES, generator=g)
        self.y = (self.x.sum(1) > 0).long()

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int):
        return self.x[i], self.y[i]


def make_model(dropout: bool = True) -> torch.nn.Module:
    """An MLP; with ``dropout`` (the default) its training steps draw from the global torch RNG."""
    torch.manual_seed(0)
    layers = [torch.nn.Linear(FEATURES, 32), torch.nn.ReLU()] + ([torch.nn.Dropout(0.2)] if dropout else [])
    return torch.nn.Sequential(*layers, torch.nn.Linear(32, 2))
