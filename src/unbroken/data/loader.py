"""``ResumableLoader``: a DataLoader whose position is exact, O(1) to restore, and
independent of ``num_workers`` and of the world size.

The position is the number of *global* samples the training loop has consumed in
the current epoch, counted when a batch is handed to the loop (never when a worker
prefetches it). Each global batch covers positions ``[p, p + world_size * batch_size)``
of the epoch's order (:class:`~unbroken.data.order.GlobalOrder`); rank ``r`` takes
the ``r``-th slice of ``batch_size``. Resuming builds the order from that position
directly, so nothing is replayed, and a different world size continues from the same
global sample: nothing repeated, nothing skipped.

The epoch ends when the loop asks for a batch after its last one: the iterator finishes and
the loader moves to the next epoch (position 0). A checkpoint taken after the last batch but
before that (at the epoch's last step) is still inside the epoch: restored, the loader's next
iterator serves nothing and closes the epoch, so a loop of the form ``for epoch ...: for batch
in loader: ...; evaluate()`` goes on with that epoch's evaluation instead of skipping into the
next epoch. In the process that served the last batch, a loop that broke out right after it
(without finishing the iterator) starts the next epoch with its next iterator, as before. A
framework that restores its own epoch loop (Lightning's) has ended the epoch itself: its
integration marks the loader's state (``"epoch_ended"``) so the next iterator starts the next epoch.

Epoch sizes: with ``drop_last=True`` the trailing ``n mod (world_size * batch_size)``
samples of the epoch's order are skipped; otherwise the last global batch is padded by
wrapping around to the start of the same epoch's order (like ``DistributedSampler``),
so every rank gets a full batch. With one process, ``drop_last=False`` instead gives a
short last batch (no padding is needed). After a resume with a different global batch,
global batches are counted from the resumed position, so the epoch still ends on a whole
global batch: fewer than one global batch of samples is dropped or padded.

Padding and dropping depend on the global batch, so after a resume on another number of ranks
the samples are the uninterrupted run's only until the next epoch end. ``continuous=True``
removes that condition: the epochs' orders form one stream, the last global batch of an epoch
is completed with the first samples of the next epoch's order (served by the same iterator),
and the next epoch starts after them. Global sample ``k`` of the run is then always sample
``k mod n`` of epoch ``k // n``'s order, and with the same global batch per optimizer step
(``batch_size * world_size * accumulation``) every step trains on the same samples on any
number of ranks, across every epoch end. Recommended for jobs that may resume elsewhere
(elastic jobs, another GPU count).
"""

from __future__ import annotations

import os
import warnings
import weakref
from collections.abc import Iterator
from typing import Any

import torch
from torch.utils.data import DataLoader, Dataset

from .checked import count
from .drawn import ORDERS, DrawnOrder
from .order import GlobalOrder, mix_ints
from .sample import SampleIndex

_FORBIDDEN = ("sampler", "batch_sampler", "generator")


def _world() -> tuple[int, int]:
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_rank(), torch.distributed.get_world_size()
    return int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))


class _RankBatches:
    """Batch sampler: this rank's slice of each global batch, from the loader's position."""

    def __init__(self, owner: ResumableLoader) -> None:
        # a weak reference: a strong one would make a cycle (loader -> DataLoader -> this), so a
        # dropped loader's persistent workers would live on until a garbage-collector pass,
        # whose shutdown then stalls (5 s join timeout per worker)
        self.owner = weakref.proxy(owner)

    def __iter__(self) -> Iterator[list[SampleIndex]]:
        o = self.owner
        epoch, pos, end = o.epoch, o.position, o.epoch_length
        g, b, lo = o.global_batch, o.batch_size, o.rank * o.batch_size
        n = o.order.n
        strided = o.strided
        while pos < end:
            stop = min(pos + g, end)
            first, last = pos + lo, min(pos + lo + b, stop)
            if strided:  # DistributedSampler's deal: positions pos + rank, pos + rank + world_size, ...
                idx = o.order.indices(epoch, pos, stop)[o.rank::o.world_size]
                yield [SampleIndex(int(i), o.seed, epoch) for i in idx]
            elif not o.continuous:
                idx = o.order.indices(epoch, first, last) if last > first else []
                yield [SampleIndex(int(i), o.seed, epoch) for i in idx]
            else:  # past n: the next epoch's order, each sample keyed by the epoch it belongs to
                mine = [SampleIndex(int(i), o.seed, epoch) for i in o.order.indices(epoch, first, min(last, n))]
                nxt = o.order.indices(epoch + 1, max(first, n) - n, last - n) if last > n else []
                yield mine + [SampleIndex(int(i), o.seed, epoch + 1) for i in nxt]
            pos = stop

    def __len__(self) -> int:
        o = self.owner
        return -(-(o.epoch_length - o.position) // o.global_batch)


class _WorkerInit:
    """Worker processes outlive a preemption signal sent to the whole process group.

    Schedulers signal the whole process group. A worker that died of that SIGTERM would
    make the DataLoader raise in the main process at an arbitrary point, possibly in the
    middle of the preemption save; the save needs nothing from the workers. So a worker
    blocks SIGTERM, SIGUSR1 and SIGINT and a thread takes them with ``sigwaitinfo``: sent by
    its parent (the DataLoader shutting it down, ``multiprocessing`` at exit) the worker
    exits; sent by anyone else (the scheduler, a Ctrl-C to the terminal's process group) it
    is ignored, and the worker ends with the main process. SIGKILL still ends it.
    """

    def __init__(self, user: Any) -> None:
        self.user = user

    def __call__(self, worker_id: int) -> None:
        import os
        import signal
        import threading

        watched = {getattr(signal, n) for n in ("SIGTERM", "SIGUSR1", "SIGINT") if hasattr(signal, n)}
        if hasattr(signal, "pthread_sigmask") and hasattr(signal, "sigwaitinfo"):
            signal.pthread_sigmask(signal.SIG_BLOCK, watched)
            parent = os.getppid()

            def take() -> None:
                while True:
                    info = signal.sigwaitinfo(watched)
                    if info.si_pid == parent:
                        os._exit(0)

            threading.Thread(target=take, name="unbroken-worker-signals", daemon=True).start()
        if self.user is not None:
            self.user(worker_id)


class ResumableLoader:
    """A ``DataLoader`` for map-style datasets whose data position is saved and restored.

    Put it in the checkpointed state (``state["data"] = loader``). Iterating yields
    the rest of the current epoch; the next ``iter()`` starts the next epoch. The
    dataset receives :class:`~unbroken.data.SampleIndex` indices (plain ``int`` s
    with ``.generator()`` for per-sample augmentation randomness).

    The arguments and their defaults are ``DataLoader``'s (``batch_size=1``, ``shuffle=False``,
    ``drop_last=False``). With ``order="dataloader"`` replacing a ``DataLoader`` changes nothing of
    an uninterrupted run, bitwise: the same batches and the same draws from the global RNG. The
    default order shuffles by ``seed`` instead (other batches than ``DataLoader``'s, no global draw).

    Args:
        dataset: a map-style dataset (``__len__`` and ``__getitem__``).
        batch_size: samples per batch *per rank* (a micro-batch with accumulation).
        shuffle: shuffle each epoch (a different order per epoch) or keep dataset order.
        seed: shuffle seed; also keys per-sample randomness and worker base seeds.
        drop_last: drop the epoch's incomplete last global batch instead of padding it.
        continuous: the epochs form one stream: an epoch's last global batch is completed
            from the next epoch's order instead of padded or dropped, so that the samples of
            every step are the same on any number of ranks across epoch ends (see the module
            docstring). Not with ``drop_last``.
        order: ``"unbroken"`` (the default): each epoch's order is a keyed permutation of
            ``(seed, epoch)``, restored in O(1) at any position, and iterating draws nothing from
            the global RNG. ``"dataloader"``: the order and the global-RNG draws of
            ``DataLoader(shuffle=...)`` itself (each epoch's iterator draws its workers' base seed
            and, shuffled, its permutation's seed from the global torch RNG), so replacing a
            ``DataLoader`` changes nothing of an uninterrupted run; ``seed`` is unused.
            ``"epoch_seeded"``: epoch ``e`` is ``torch.randperm(n)`` seeded ``seed + e`` (Accelerate's
            ``SeedableRandomSampler``, used by the HF Trainer), with the ``DataLoader``'s base-seed
            draw. ``"distributed"``: ``DistributedSampler(seed=seed)``'s permutation, padding and deal
            to the ranks (Lightning with several devices). All three keep what they drew in the state
            (a resume draws nothing) and hold the epoch's permutation in memory (8 bytes a sample,
            :mod:`unbroken.data.drawn`); not with ``continuous``.
        rank: this process's slice; default from ``torch.distributed`` when initialized,
            else ``RANK``, else 0.
        world_size: the number of slices; default from ``torch.distributed`` when
            initialized, else ``WORLD_SIZE``, else 1.
        **loader_kwargs: passed to ``torch.utils.data.DataLoader`` (``num_workers``,
            ``collate_fn``, ``pin_memory``, ``persistent_workers``, ...). ``sampler``,
            ``batch_sampler`` and ``generator`` are owned by this class.
    """

    def __init__(self, dataset: Dataset, batch_size: int = 1, shuffle: bool = False, *, seed: int = 0,
                 drop_last: bool = False, continuous: bool = False, rank: int | None = None,
                 world_size: int | None = None, order: str = "unbroken", **loader_kwargs: Any) -> None:
        bad = [k for k in _FORBIDDEN if k in loader_kwargs]
        if bad:
            raise TypeError(f"ResumableLoader owns {bad}; pass seed=/shuffle= instead")
        if batch_size < 1:
            raise ValueError("batch_size must be at least 1")
        if continuous and drop_last:
            raise ValueError("continuous=True completes an epoch's last batch from the next epoch: nothing is "
                             "dropped; pass one of continuous=True and drop_last=True")
        if order not in ORDERS:
            raise ValueError(f"order must be one of {', '.join(map(repr, ORDERS))}, not {order!r}")
        if continuous and order != "unbroken":
            raise ValueError(f"continuous=True needs the next epoch's order before that epoch's iterator starts, "
                             f"which order={order!r} draws only then: use order='unbroken' with continuous=True")
        r, w = _world()
        self.rank = r if rank is None else rank
        self.world_size = w if world_size is None else world_size
        if not 0 <= self.rank < self.world_size:
            raise ValueError(f"rank {self.rank} is outside world size {self.world_size}")
        self.dataset = dataset
        self.batch_size = batch_size
        self.seed = seed
        self.drop_last = drop_last
        self.continuous = bool(continuous)
        self._persistent = bool(loader_kwargs.get("persistent_workers")) and bool(loader_kwargs.get("num_workers"))
        self.order: GlobalOrder | DrawnOrder = self._make_order(order, len(dataset), seed, shuffle)  # type: ignore[arg-type]
        # an integration that chose the order for the user (HF's) resumes a run saved in another order in that one
        self.adopts_saved_order = False
        if self.continuous and self.order.n < self.global_batch:
            raise ValueError(f"continuous=True needs at least one global batch of samples: the dataset has "
                             f"{self.order.n}, a global batch is {self.global_batch}")
        self.epoch = 0
        self.position = 0
        self.samples_seen = 0
        self._restores = 0  # load_state_dict() calls: an iterator started before one is stale
        self._served_end = False  # this process handed out the epoch's last batch (see the module docstring)
        self._generator = torch.Generator()
        loader_kwargs["worker_init_fn"] = _WorkerInit(loader_kwargs.get("worker_init_fn"))
        self._loader = DataLoader(dataset, batch_sampler=_RankBatches(self), generator=self._generator,
                                  **loader_kwargs)

    def _make_order(self, order: str, n: int, seed: int, shuffle: bool) -> GlobalOrder | DrawnOrder:
        if order == "unbroken":
            return GlobalOrder(n, seed, shuffle)
        return DrawnOrder(n, seed, shuffle, order, base_draw_each_epoch=not self._persistent)

    @property
    def global_batch(self) -> int:
        return self.batch_size * self.world_size

    @property
    def epoch_length(self) -> int:
        """Where the current epoch ends: ``n`` rounded down (drop_last) or up (padding) to
        whole global batches counted from the current position, so that after a resume with
        another global batch (position not a multiple of it) every rank still gets a full
        last batch (with one process and padding, the epoch ends at ``n``: a short batch)."""
        n, g = self.order.n, self.global_batch
        if self.strided:  # DistributedSampler: n padded to a multiple of the world size; per rank, drop_last drops
            per_rank = -(-n // self.world_size)  # its short last batch
            per_rank = per_rank // self.batch_size * self.batch_size if self.drop_last else per_rank
            return max(self.position, per_rank * self.world_size)
        if self.continuous:  # completed from the next epoch: whole batches from the position, no wrapping
            return self.position + max(0, -(-(n - self.position) // g)) * g
        if self.world_size == 1 and not self.drop_last:
            return n
        phase = self.position % g
        if self.drop_last:
            return phase + max(0, n - phase) // g * g
        return phase + -(-(n - phase) // g) * g

    @property
    def strided(self) -> bool:
        """``order="distributed"``: each global batch dealt to the ranks in turn (``DistributedSampler``'s way)."""
        return isinstance(self.order, DrawnOrder) and self.order.mode == "distributed"

    def __len__(self) -> int:
        """Batches this rank yields in a whole epoch (from position 0)."""
        n, g = self.order.n, self.global_batch
        if self.strided:
            per_rank = -(-n // self.world_size)
            return per_rank // self.batch_size if self.drop_last else -(-per_rank // self.batch_size)
        return n // g if self.drop_last else -(-n // g)

    def batches_left(self) -> int:
        """Batches left in the current epoch."""
        return -(-(self.epoch_length - self.position) // self.global_batch)

    def batches_done(self) -> int:
        """Batches of the current epoch already served: after a resume, where the epoch's batch index goes
        on. ``for batch_idx, batch in enumerate(loader, loader.batches_done()):`` prints and logs the
        uninterrupted run's indices (a plain ``enumerate`` starts a resumed epoch at 0)."""
        if self.continuous:  # the epoch began after the samples its predecessor took (fewer than a batch)
            return self.position // self.global_batch
        return -(-self.position // self.global_batch)

    def __iter__(self) -> Iterator[Any]:
        if self.position >= self.epoch_length and self._served_end:
            self._next_epoch()  # this process served the epoch's end: the loop asks for the next epoch
        # (restored at an epoch's end, a checkpoint of its last step, nothing is left of it: the
        # iterator below serves nothing, and the epoch ends)
        if isinstance(self.order, DrawnOrder):  # the draws of torch's DataLoader, once per epoch (kept in the state)
            if self.order.drawn_epoch != self.epoch and self.position < self.epoch_length:
                self.order.draw(self.epoch)
            rng = self.order.worker_generator_state()
            if rng is not None:  # the inner DataLoader draws the same base seed again, from its own generator
                self._generator.set_state(rng)
            else:  # restored into this epoch (see DrawnOrder.worker_generator_state)
                self._generator.manual_seed(mix_ints(self.seed, self.epoch, self.order.sampler_seed or 0) >> 1)
        else:
            # Worker base seeds come from our own generator, never from the global RNG, so
            # creating this iterator changes no random stream of the training loop.
            self._generator.manual_seed(mix_ints(self.seed, self.epoch, 0xDA7A) >> 1)
        born = self._restores
        for batch in self._loader:
            if self._restores != born:
                raise RuntimeError(
                    "this iterator of the ResumableLoader was started before restore() loaded a new data "
                    "position: it would serve batches of the old order. Create the iterator after restore() "
                    "(`for batch in loader:` inside the training loop).")
            end = self.epoch_length
            new = min(self.position + self.global_batch, end)
            self.samples_seen += new - self.position
            self.position = new
            self._served_end = new >= end
            yield batch
        if self.position >= self.epoch_length:
            self._next_epoch()

    def _next_epoch(self) -> None:
        # continuous: the samples of the new epoch that the last batch took are behind its start
        carried = max(0, self.position - self.order.n) if self.continuous else 0
        self.epoch += 1
        self.position = carried
        self._served_end = False

    def set_epoch(self, epoch: int) -> None:
        """Start ``epoch`` at its first batch, unless the loader is in ``epoch`` already: then it
        keeps its position (a resumed run goes on mid-epoch). Like ``DistributedSampler.set_epoch``;
        :meth:`unbroken.Checkpointer.end_epoch` calls it with the loop's next epoch."""
        if epoch < 0:
            raise ValueError(f"epoch must be a non-negative integer, not {epoch!r}")
        if int(epoch) != self.epoch:
            self.epoch, self.position, self._served_end = int(epoch), 0, False

    def state_dict(self) -> dict[str, Any]:
        out = {"epoch": self.epoch, "position": self.position, "samples_seen": self.samples_seen,
               "seed": self.seed, "n": self.order.n, "shuffle": self.order.shuffle,
               "world_size": self.world_size, "batch_size": self.batch_size, "drop_last": self.drop_last,
               "continuous": self.continuous}
        if isinstance(self.order, DrawnOrder):
            out.update(self.order.state_dict())
        return out

    def load_state_dict(self, state: dict[str, Any]) -> None:
        n = self.order.n
        saved_batch = count(state, "world_size", "loader", lo=1) * count(state, "batch_size", "loader", lo=1)
        # an epoch padded to whole global batches of the saving run ends past n by less than one of them
        epoch = count(state, "epoch", "loader")
        position = count(state, "position", "loader", hi=n + max(saved_batch, self.global_batch))
        samples_seen = count(state, "samples_seen", "loader")
        mode = self.order.mode if isinstance(self.order, DrawnOrder) else "unbroken"
        saved_mode = state.get("order", "unbroken")
        adopt = (saved_mode != mode and self.adopts_saved_order and saved_mode in ORDERS
                 and isinstance(state["seed"], int))
        seed = state["seed"] if adopt else self.seed
        mode = saved_mode if adopt else mode
        if state["n"] != self.order.n or state["seed"] != seed or state["shuffle"] != self.order.shuffle:
            raise ValueError(
                f"the checkpoint's data order (n={state['n']}, seed={state['seed']}, shuffle={state['shuffle']}) "
                f"differs from this loader's (n={self.order.n}, seed={self.seed}, shuffle={self.order.shuffle}); "
                "the dataset or seed changed, so the saved position means nothing here"
                + ("; shuffle=True was the default of ResumableLoader before 0.2: pass it to resume such a run"
                   if state["shuffle"] and not self.order.shuffle else ""))
        if saved_mode != mode:
            raise ValueError(f"the checkpoint's loader was made with order={saved_mode!r}, this "
                             f"one with order={mode!r}: the saved position means another sample here; pass the "
                             "checkpoint's order")
        if bool(state.get("continuous", False)) != self.continuous:
            raise ValueError(f"the checkpoint's loader was made with continuous={not self.continuous}, this one "
                             f"with continuous={self.continuous}: epochs end at other samples, so the saved "
                             "position means something else here; pass the checkpoint's setting")
        saved_global = state["world_size"] * state["batch_size"]
        if saved_global != self.global_batch and state["position"] % self.global_batch:
            warnings.warn(
                f"global batch changed from {saved_global} to {self.global_batch}; "
                "continuing exactly from global sample "
                f"{state['position']} of epoch {state['epoch']} (batch boundaries shift)", stacklevel=2)
        if state["world_size"] != self.world_size and not self.continuous:
            warnings.warn(
                f"world size changed from {state['world_size']} to {self.world_size}: the samples continue exactly, "
                "but the epoch's last global batch is padded (or dropped) to the new size, so from the next epoch "
                "on each step's samples differ from a run that kept the old world size; "
                "ResumableLoader(..., continuous=True) keeps them the same across epoch ends", stacklevel=2)
        if adopt:
            warnings.warn(f"the run was saved with the data order {saved_mode!r} (seed {seed}): it goes on in that "
                          f"order, not in the one chosen now, so that it stays the run it was", stacklevel=2)
            self.seed, self.order = seed, self._make_order(saved_mode, self.order.n, seed, self.order.shuffle)
        self.epoch, self.position, self.samples_seen = epoch, position, samples_seen
        if isinstance(self.order, DrawnOrder):
            self.order.load_state_dict(state)
        # restored at an epoch's end: its next iterator serves nothing and ends the epoch; unless the
        # state says the loop that consumes it ended the epoch itself (``"epoch_ended": True``, set by
        # integrations whose framework restores its own epoch loop, e.g. Lightning's): then the next
        # iterator starts the next epoch
        self._served_end = bool(state.get("epoch_ended", False))
        self._restores += 1
