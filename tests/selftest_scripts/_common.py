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
    def __init__(self) -> None:
        g = torch.Generator().manual_seed(0)
        self.x = torch.randn(N, FEATURES, generator=g)
        self.y = (self.x.sum(1) > 0).long()

    def __len__(self) -> int:
        return N

    def __getitem__(self, i: int):
        return self.x[i], self.y[i]


def make_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(FEATURES, 32), torch.nn.ReLU(), torch.nn.Dropout(0.2),
                               torch.nn.Linear(32, 2))
