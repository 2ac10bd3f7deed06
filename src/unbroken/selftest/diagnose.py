"""Which components differ -> the likely cause in plain words, and the fix.

The first diverging record (:mod:`.compare`) is read like this, first rule that applies:

1. the state *as restored* differs from the state saved at that step -> the object does not
   round-trip through ``state_dict()``/``load_state_dict()`` (or the RNGs are not restored);
2. the batch (sample indices, contents) differs -> the data order is not in the state (a
   sampler that restarts its epoch); or, when the saved data position agrees, the iterator
   was created before ``restore()``; or, without any interruption, unseeded shuffling;
3. a global RNG stream differs before the first batch of the step, though it was restored
   exactly -> something draws from the global RNG between ``restore()`` and the first step;
4. gradients, loss or parameters differ while the batch, the RNG and the parameters before
   the step agree -> without any interruption: a non-deterministic operation; after a resume:
   a generator the script holds outside the state (when one was found restarted), else
   unsaved state (an accumulator, a counter);
5. optimizer moments differ while the gradients agree -> the optimizer does not round-trip;
6. another state key differs -> that object's state is incomplete.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from .compare import Divergence

_STREAMS = {"python": "python's global RNG (random)", "numpy": "numpy's global RNG", "torch": "the torch CPU RNG"}
_DATA_WORDS = ("loader", "data", "sampler", "iter", "batch")


def describe(name: str) -> str:
    """A component name in plain words."""
    if name == "batch/indices":
        return "the batch's sample indices"
    if name == "batch/data":
        return "the batch's contents"
    if name.startswith("batch/rng/") or name.startswith("rng/"):
        stream = name.rsplit("/", 1)[1]
        text = _STREAMS.get(stream, f"the {stream} RNG")
        return text + (" before the first batch of the step" if name.startswith("batch/") else "")
    if name.startswith("metric/"):
        return f"the {name[7:]} passed to ckpt.step()"
    if name == "progress":
        return "ckpt.progress"
    key, _, part = name.partition("/")
    if not part:
        return f"state[{key!r}]"
    part = {"parameters": "parameters", "buffers": "buffers", "gradients": "gradients before optimizer.step()",
            "hyperparameters": "hyperparameters (lr, ...)", "position": "data position"}.get(part, part)
    if part.startswith("moments:"):
        part = f"optimizer state {part[8:]!r}"
    return f"state[{key!r}]'s {part}" if key != "optimizer outside the state" else f"the {part} of an optimizer outside the state"


@dataclass
class Diagnosis:
    headline: str
    cause: str
    fix: str

    def as_dict(self) -> dict[str, str]:
        return {"headline": self.headline, "cause": self.cause, "fix": self.fix}


def differ(name: str) -> str:
    """``"differ"`` or ``"differs"``, agreeing with :func:`describe`."""
    plural = ("indices", "data", "gradients", "parameters", "buffers", "hyperparameters", "moments:")
    return "differ" if any(p in name for p in plural) and not name.startswith("metric/") else "differs"


def _where(d: Divergence) -> str:
    if d.resumed_from is not None:
        return f"after the resume at step {d.resumed_from}"
    return "before any interruption" if d.segment == 0 else "in a process that started from scratch"


def _data_key(names: list[str]) -> str | None:
    for n in names:
        key, _, part = n.partition("/")
        if part == "position" or (not part and any(w in key.lower() for w in _DATA_WORDS)):
            return n
    return None


def diagnose(d: Divergence) -> Diagnosis:
    """The cause and fix of a divergence; its headline names the rank when there are several."""
    g = _diagnose(d)
    return g if d.rank is None else replace(g, headline=f"rank {d.rank}, {g.headline}")


def _diagnose(d: Divergence) -> Diagnosis:
    first, where, resumed = d.differ[0], _where(d), d.resumed_from is not None
    head = f"step {d.step}: {describe(first)} {differ(first)} {where}"
    if d.kind == "restore":
        if first.startswith("rng/") and not resumed:
            return Diagnosis(f"step {d.step}: {describe(first)} {differ(first)} from the start, before any interruption",
                             f"{describe(first)} is not seeded (it seeds itself from the OS) and the script draws "
                             "from it, so no two runs are alike", "seed it once at startup (random.seed(0), "
                             "np.random.seed(0), torch.manual_seed(0)), before the Checkpointer restores")
        if first.startswith("rng/"):
            return Diagnosis(f"step {d.step}: {describe(first)} as restored {differ(first)} from the saved step",
                             "the global RNG streams are not restored", "keep Checkpointer(rng=True)")
        return Diagnosis(f"step {d.step}: {describe(first)} as restored {differ(first)} from what it was at that step",
                         f"{describe(first)} does not round-trip: its state_dict() leaves out something its "
                         "behaviour depends on, or load_state_dict() does not put it all back",
                         "make state_dict() return everything the object changes during training")
    if first in ("batch/indices", "batch/data"):
        if not resumed:
            return Diagnosis(head, "the data order is not reproducible even without an interruption (shuffling "
                             "from an unseeded source, or an order that depends on the file system or the time)",
                             "seed the order: use unbroken.data.ResumableLoader(dataset, batch_size, seed=...)")
        data = _data_key(d.agree)
        if data is not None:
            return Diagnosis(head, f"the data position was restored ({describe(data)} agrees), but the batches "
                             "served after the resume do not follow it: the data iterator was created before "
                             "restore(), so it serves the order it started with",
                             "create the iterator after ckpt.restore(state) (`for batch in loader:` inside the loop)")
        data = _data_key(d.differ)
        if data is not None:
            return Diagnosis(head, f"{describe(data)} is not resumed exactly: its state_dict() does not capture "
                             "where the epoch stands", "use unbroken.data.ResumableLoader and put it in the state")
        return Diagnosis(head, "the DataLoader's sampler is not in the state: after a restart it begins its epoch "
                         "again, with a new order drawn from the global RNG",
                         "use unbroken.data.ResumableLoader and put it in the state (state['data'] = loader)")
    if first.startswith("batch/rng/"):
        if not resumed:
            return Diagnosis(head, "the global RNG is not reproducible even without an interruption (seeded from "
                             "the time, the pid, or not seeded)", "seed it once at startup: torch.manual_seed(0)")
        at_first = d.step == d.resumed_from + 1
        return Diagnosis(head, ("something draws from the global RNG between restore() and the first step (it was "
                                "restored exactly): creating a module, a warm-up call, a plain DataLoader iterator")
                         if at_first else "something between two steps draws from the global RNG differently after "
                         "the resume (its behaviour depends on something not in the state)",
                         "move that code before ckpt.restore(state), or give it its own torch.Generator in the state")
    computed = ("/gradients", "metric/", "/parameters", "/buffers")
    if any(p in first for p in computed):
        what = describe(first)
        if not resumed:
            return Diagnosis(f"step {d.step}: {what} {differ(first)} {where}, though the batch, the RNG streams and the "
                             "state before the step agree",
                             "a non-deterministic operation: the same inputs gave different results",
                             "torch.use_deterministic_algorithms(True) (on CUDA also CUBLAS_WORKSPACE_CONFIG=:4096:8); "
                             "avoid order-dependent accumulation (atomics, index_add_/scatter_add_ on GPU, "
                             "iteration over sets)")
        if "unsaved generators" in d.restore_differ:
            return Diagnosis(f"{head}, though the batch and the global RNG streams agree",
                             "a random generator the script holds outside the state (a torch.Generator, a numpy "
                             "Generator, a random.Random) restarted from its seed at the resume",
                             "put the generator in the state (state['gen'] = g): unbroken saves and restores it")
        return Diagnosis(f"{head}, though the batch, the global RNG streams and the restored state agree",
                         "something the step depends on is not in the state (an accumulator, a running statistic, "
                         "a counter, a cache): after the resume it starts again from its initial value",
                         "put it in the state: a plain value, or any object with state_dict()/load_state_dict()")
    if "/moments:" in first or first.endswith("/hyperparameters"):
        return Diagnosis(f"{head}, though its gradients agree",
                         "the optimizer does not continue exactly: its state_dict() leaves something out, or "
                         "something outside it changes its state (an LR set by hand from a variable not in the state)",
                         "keep everything the optimizer depends on in the state")
    if first.startswith("rng/"):
        return Diagnosis(head, "the step drew a different number of random numbers (code whose behaviour depends "
                         "on something not in the state)", "put that state in the checkpointed state")
    return Diagnosis(head, f"{describe(first)} does not continue exactly: it depends on something that is not in "
                     "its state_dict() or not in the state",
                     "make its state_dict() cover everything it changes, and keep what it depends on in the state")
