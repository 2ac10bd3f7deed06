"""Synthetic stand-ins for the data of the upstream examples (no downloads in tests).

``MNIST(train)`` replaces ``torchvision.datasets.MNIST`` (with its ``ToTensor`` and ``Normalize``
already applied): tiny 12 x 12 images with labels that depend on them, so the model learns.
``Corpus(path)`` replaces ``word_language_model/data.py``'s ``Corpus``: ``dictionary``, ``train``,
``valid`` and ``test`` token tensors drawn from a small Markov chain over a 20-word vocabulary.
Both are pure functions of fixed seeds.
"""

from __future__ import annotations

import torch
from torch.utils.data import Dataset


class MNIST(Dataset):
    def __init__(self, train: bool = True) -> None:
        n = 64 if train else 32
        g = torch.Generator().manual_seed(1 if train else 2)
        self.targets = torch.randint(0, 10, (n,), generator=g)
        pattern = torch.randn(10, 1, 12, 12, generator=torch.Generator().manual_seed(0))
        self.data = pattern[self.targets] + 0.8 * torch.randn(n, 1, 12, 12, generator=g)

    def __len__(self) -> int:
        return len(self.targets)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        return self.data[index], int(self.targets[index])


class Dictionary:
    def __init__(self, words: int) -> None:
        self.idx2word = [f"w{i}" for i in range(words)]
        self.word2idx = {w: i for i, w in enumerate(self.idx2word)}

    def __len__(self) -> int:
        return len(self.idx2word)


class Corpus:
    def __init__(self, path: str, words: int = 20) -> None:
        self.dictionary = Dictionary(words)
        g = torch.Generator().manual_seed(5)
        nxt = torch.randint(0, words, (words, 3), generator=g)  # each word is followed by one of 3 words
        self.train, self.valid, self.test = (self._chain(nxt, n, g) for n in (124, 60, 60))

    @staticmethod
    def _chain(nxt: torch.Tensor, n: int, g: torch.Generator) -> torch.Tensor:
        ids = [0]
        for c in torch.randint(0, 3, (n - 1,), generator=g).tolist():
            ids.append(int(nxt[ids[-1], c]))
        return torch.tensor(ids, dtype=torch.int64)
