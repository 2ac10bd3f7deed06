"""Which components differ, and what the records show around them -> the cause in plain words, and the fix.

A cause is printed only when the evidence (:mod:`.evidence`) agrees with it; otherwise the
diagnosis says plainly that it cannot tell (``known`` is false) and the report shows the first
differing component and its values. The first diverging record (:mod:`.compare`) is read like
this, first rule that applies:

1. the state *as restored* differs from the state saved at that step -> the object does not
   round-trip through ``state_dict()``/``load_state_dict()`` (or the RNGs are not restored);
2. the training batch (sample indices, contents) differs -> without any interruption, an
   unseeded order; after a resume: no state key holds a data position (the sampler restarts
   its epoch); the data position differs (it is not resumed exactly); the data position agrees
   and the training iterator was created before ``restore()`` (it serves its old order);
3. a global RNG stream differs at the step's first training batch, and the step draws from it
   -> whichever run drew from it since the previous step: the resumed process between
   ``restore()`` and its first batch (code there draws), or the uninterrupted run between two
   steps where the resumed process did not (the work between them, an evaluation every K steps
   run after ``ckpt.step()``, came after the checkpoint the resume started from; the cause says
   that the training data's epoch ended there only when the records show it did); or it
   differed since an earlier step that drew nothing from it, and this is the first step that does;
4. gradients, loss or parameters differ while the batch, the RNG and the state before the step
   agree -> without any interruption: a non-deterministic operation; after a resume: a
   generator the script holds outside the state (one was found restarted), a variable of the
   loop carried from step to step (named: it differs at the start of the step), a global RNG
   stream that already differed and was drawn from before the first batch; else unknown;
5. optimizer moments differ while the gradients agree -> the optimizer does not round-trip;
6. another state key differs -> that object's state is incomplete.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from .compare import Divergence

_STREAMS = {"python": "python's global RNG (random)", "numpy": "numpy's global RNG", "torch": "the torch CPU RNG"}
_DATA_WORDS = ("loader", "data", "sampler", "iter", "batch")


def describe(name: str) -> str:
    """A component name in plain words."""
    if name == "batch/indices":
        return "the batch's sample indices"
    if name == "batch/data":
        return "the batch's contents"
    if name.startswith(("batch/rng/", "rng/")):
        text = stream_words(name.rsplit("/", 1)[1])
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
    if key == "optimizer outside the state":
        return f"the {part} of an optimizer outside the state"
    return f"state[{key!r}]'s {part}"


def stream_words(stream: str) -> str:
    """A global RNG stream's name (``torch``) in plain words."""
    return _STREAMS.get(stream, f"the {stream} RNG")


@dataclass
class Diagnosis:
    """A divergence explained: a headline, the cause and fix, and the facts the cause rests on."""

    headline: str
    cause: str
    fix: str
    evidence: str = ""
    """The facts of the records the cause rests on (or that rule the usual causes out)."""
    known: bool = True
    """False: the selftest cannot tell the cause; the report shows the first differing values."""

    def as_dict(self) -> dict[str, Any]:
        return {"headline": self.headline, "cause": self.cause, "fix": self.fix, "evidence": self.evidence,
                "known": self.known}


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


def unknown(d: Divergence, head: str, ruled_out: str) -> Diagnosis:
    """The plain "cannot tell": what the records rule out, and the first differing component and values."""
    first = d.differ[0]
    a, b = d.values.get(first, (None, None))
    return Diagnosis(head, f"cannot tell: {ruled_out}. The first difference is {describe(first)}: {a} in the "
                     f"uninterrupted run, {b} in the interrupted one",
                     "compare the two runs' records of this step (records.jsonl in --workdir: every component and "
                     "the loop's variables), and put whatever the step reads that the state lacks into the state",
                     ruled_out, known=False)


def diagnose(d: Divergence) -> Diagnosis:
    """The cause and fix of a divergence; its headline names the rank when there are several."""
    g = _diagnose(d)
    return g if d.rank is None else replace(g, headline=f"rank {d.rank}, {g.headline}")


def _diagnose(d: Divergence) -> Diagnosis:
    first, where, resumed = d.differ[0], _where(d), d.resumed_from is not None
    head = f"step {d.step}: {describe(first)} {differ(first)} {where}"
    if d.kind == "restore":
        return _restored(d, first, resumed)
    if first in ("batch/indices", "batch/data"):
        return _batches(d, head, resumed)
    if first.startswith("batch/rng/"):
        return _rng(d, head, first.rsplit("/", 1)[1], resumed)
    if any(p in first for p in ("/gradients", "metric/", "/parameters", "/buffers")):
        return _computed(d, head, first, where, resumed)
    grads_agree = any(k.endswith("/gradients") for k in d.agree)
    if ("/moments:" in first or first.endswith("/hyperparameters")) and grads_agree:
        return Diagnosis(f"{head}, though its gradients agree",
                         "the optimizer does not continue exactly: its state_dict() leaves something out, or "
                         "something outside it changes its state (an LR set by hand from a variable not in the state)",
                         "keep everything the optimizer depends on in the state",
                         "its gradients before optimizer.step() agree, so its own state made the difference")
    if first.startswith("rng/") and f"batch/{first}" in d.agree:
        return Diagnosis(head, "the step drew a different number of random numbers (code whose behaviour depends "
                         "on something not in the state)", "put that state in the checkpointed state",
                         f"{stream_words(first[4:])} agreed at the step's first batch and differs at its end")
    if "/moments:" in first or first.endswith("/hyperparameters") or first.startswith("rng/"):
        return unknown(d, head, "no gradients before optimizer.step() or RNG stream at the step's first batch were "
                       "recorded to compare, so the step's inputs cannot be checked")
    return Diagnosis(head, f"{describe(first)} does not continue exactly: it depends on something that is not in "
                     "its state_dict() or not in the state",
                     "make its state_dict() cover everything it changes, and keep what it depends on in the state",
                     "the batch, the RNG streams, the gradients and the parameters agree")


def _restored(d: Divergence, first: str, resumed: bool) -> Diagnosis:
    if first.startswith("rng/") and not resumed:
        return Diagnosis(f"step {d.step}: {describe(first)} {differ(first)} from the start, before any interruption",
                         f"{describe(first)} is not seeded (it seeds itself from the OS) and the script draws "
                         "from it, so no two runs are alike", "seed it once at startup (random.seed(0), "
                         "np.random.seed(0), torch.manual_seed(0)), before the Checkpointer restores",
                         "the two runs' fresh starts differ in it, and the uninterrupted run draws from it")
    if first.startswith("rng/"):
        return Diagnosis(f"step {d.step}: {describe(first)} as restored {differ(first)} from the saved step",
                         "the global RNG streams are not restored", "keep Checkpointer(rng=True)",
                         "the state as restored differs from the state this run saved at that step")
    if not resumed:
        return Diagnosis(f"step {d.step}: {describe(first)} {differ(first)} {_where(d)}, before the first step",
                         f"{describe(first)} is initialised differently in the two runs (from an unseeded random "
                         "source, the time, or the file system)", "seed everything the script initialises "
                         "(torch.manual_seed(0) before building the model)",
                         "the two runs' states differ before any step ran and no checkpoint was restored")
    return Diagnosis(f"step {d.step}: {describe(first)} as restored {differ(first)} from what it was at that step",
                     f"{describe(first)} does not round-trip: its state_dict() leaves out something its "
                     "behaviour depends on, or load_state_dict() does not put it all back",
                     "make state_dict() return everything the object changes during training",
                     "the state as restored differs from the state this run saved at that step")


def _batches(d: Divergence, head: str, resumed: bool) -> Diagnosis:
    if not resumed:
        return Diagnosis(head, "the data order is not reproducible even without an interruption (shuffling "
                         "from an unseeded source, or an order that depends on the file system or the time)",
                         "seed the order: use unbroken.data.ResumableLoader(dataset, batch_size, shuffle=True, "
                         "seed=...)",
                         "no interruption came before this step")
    born = d.evidence.get("iterator")
    data = _data_key(d.agree)
    if data is not None:
        if born == "before restore":
            return Diagnosis(head, f"the data position was restored ({describe(data)} agrees), but the batches "
                             "served after the resume do not follow it: the data iterator was created before "
                             "restore(), so it serves the order it started with",
                             "create the iterator after ckpt.restore(state) (`for batch in loader:` inside the "
                             "loop); a torch DataLoader draws its iterator's seed from the global RNG, so give it "
                             "its own: DataLoader(..., generator=torch.Generator())",
                             "the training DataLoader's iterator of this step was created before restore()")
        return unknown(d, head, f"the data position was restored ({describe(data)} agrees) and the training "
                       "iterator was created after restore(), so neither an unsaved sampler nor an iterator made "
                       "before restore() explains the other batches (does the training read from the loader in "
                       "the state?)")
    data = _data_key(d.differ)
    if data is not None:
        return Diagnosis(head, f"{describe(data)} is not resumed exactly: its state_dict() does not capture "
                         "where the epoch stands", "use unbroken.data.ResumableLoader and put it in the state",
                         f"{describe(data)} differs at this step")
    return Diagnosis(head, "the DataLoader's sampler is not in the state: after a restart it begins its epoch "
                     "again, with a new order drawn from the global RNG",
                     "use unbroken.data.ResumableLoader and put it in the state before ckpt.restore(state) "
                     "(state['data'] = loader)",
                     "no state key holds a data position" + (
                         "; the training iterator was created after the resume" if born == "this step" else ""))


def _side(ev: dict[str, Any]) -> str:
    """The work between two steps that the uninterrupted run did and the interrupted one did not, in words."""
    a, b = (ev.get("side") or [0, 0])[:2]
    ended = (ev.get("epoch_end") or [False, False])[0]
    parts = []
    if ended:
        parts.append("after the training data's epoch ended")
    if a != b:
        parts.append(f"{a} batch{'es' if a != 1 else ''} of another DataLoader (an evaluation?), {b} after the resume")
    return f" ({'; '.join(parts)})" if parts else ""


def _rng(d: Divergence, head: str, stream: str, resumed: bool) -> Diagnosis:
    words = stream_words(stream)
    if not resumed:
        return Diagnosis(head, "the global RNG is not reproducible even without an interruption (seeded from "
                         "the time, the pid, or not seeded)", "seed it once at startup: torch.manual_seed(0)",
                         "no interruption came before this step")
    ev = d.evidence
    ref_drew, got_drew = (ev.get("drew_before", {}).get(stream) or [None, None])[:2]
    at_first = ev.get("previous") == "restore"
    since = (ev.get("rng_differs_since") or {}).get(stream)
    if got_drew and not ref_drew and at_first:
        return Diagnosis(head, "something draws from the global RNG between restore() and the first step (it was "
                         "restored exactly): creating a module, a warm-up call, a plain DataLoader iterator",
                         "move that code before ckpt.restore(state), or give it its own torch.Generator in the state",
                         f"after the resume {words} changed between restore() and the first batch; in the "
                         f"uninterrupted run it did not change between step {d.step - 1} and that batch")
    if ref_drew and not got_drew:
        return Diagnosis(head, f"the work between steps {d.step - 1} and {d.step} drew from {words} in the "
                         f"uninterrupted run{_side(ev)} but did not run after the resume at step {d.resumed_from}: the "
                         "checkpoint was taken before it, and the resumed loop went on past it; the training's "
                         "own draws (dropout, augmentation) then differ",
                         "make that work leave the global RNG alone (give its DataLoader its own generator: "
                         "DataLoader(eval_set, generator=torch.Generator()); its random ops a torch.Generator), "
                         "or run it before the step whose checkpoint a resume starts from",
                         f"in the uninterrupted run {words} changed between step {d.step - 1} and step {d.step}'s "
                         "first batch; after the resume it did not change before that batch")
    if ref_drew and got_drew:
        return Diagnosis(head, f"the code before step {d.step}'s first batch drew from {words} in both runs, but "
                         f"differently{_side(ev)}: its behaviour depends on something not in the state",
                         "keep what that code depends on in the state, or give it its own torch.Generator",
                         "both runs drew from it between the previous step and this step's first batch")
    if since is not None:
        return Diagnosis(head, f"{words} differs since step {since['step']} (after the resume at step "
                         f"{since['resumed_from']}{_side(since)}), where no step drew from it; step {d.step} is the "
                         "first to draw from it", "make the work that drew from it in one run only leave the "
                         "global RNG alone (its own torch.Generator), or run it before the step a resume starts from",
                         f"{words} differed at step {since['step']} without being drawn from; nothing drew from it "
                         f"between step {d.step - 1} and step {d.step}'s first batch in either run")
    return unknown(d, head, f"{words} differs at the step's first batch, yet neither run drew from it since the "
                   "previous record, and it did not differ before")


def _computed(d: Divergence, head: str, first: str, where: str, resumed: bool) -> Diagnosis:
    what = describe(first)
    if not resumed:
        return Diagnosis(f"step {d.step}: {what} {differ(first)} {where}, though the batch, the RNG streams and the "
                         "state before the step agree",
                         "a non-deterministic operation: the same inputs gave different results",
                         "torch.use_deterministic_algorithms(True) (on CUDA also CUBLAS_WORKSPACE_CONFIG=:4096:8); "
                         "avoid order-dependent accumulation (atomics, index_add_/scatter_add_ on GPU, "
                         "iteration over sets)", "no interruption came before this step")
    if "unsaved generators" in d.restore_differ:
        return Diagnosis(f"{head}, though the batch and the global RNG streams agree",
                         "a random generator the script holds outside the state (a torch.Generator, a numpy "
                         "Generator, a random.Random) restarted from its seed at the resume",
                         "put the generator in the state before ckpt.restore(state) (state['gen'] = g): unbroken saves "
                         "and restores it",
                         "a generator found in the script's variables was restored to another state than it had")
    ev = d.evidence
    carried = ev.get("carried") or []
    if carried:
        return _carried(d, head, carried)
    differing = ev.get("rng_not_drawn") or []
    early = [s for s in differing if ((ev.get("drew_before") or {}).get(s) or [None, None])[1]]
    if early:
        words = ", ".join(stream_words(s) for s in early)
        return Diagnosis(f"{head}, though the batch and the restored state agree",
                         f"{words} already differed, and the code before the step's first batch draws from it "
                         "and feeds the step (noise or a random choice drawn before the batch is fetched)",
                         "draw the step's random numbers from a torch.Generator kept in the state, and make the "
                         "work that drew from the global RNG in one run only leave it alone",
                         f"{words} differs at this step; after the resume it changed between the previous record "
                         "and the step's first batch")
    named = ", ".join(stream_words(s) for s in differing)
    also = f"; {named} differ too, but no step drew from them" if differing else ""
    return unknown(d, f"{head}, though the batch, the global RNG streams and the restored state agree",
                   "the state as restored, the training batch and the global RNG streams agree, no generator "
                   "outside the state restarted, and no plain variable of the loop differs at the start of the "
                   "step; what the step reads from elsewhere (an object's attribute, a closure, a module-level "
                   f"cache, a file) was not recorded{also}")


def _carried(d: Divergence, head: str, carried: list[dict[str, Any]]) -> Diagnosis:
    """A value the loop carries from step to step outside the state. The fix is an ``unbroken.Vars`` in the
    state *before* ``restore()``: a key added to the state only later is never restored."""
    shown = [c["name"] for c in carried[:4]]
    names = ", ".join(f"`{n}`" for n in shown)
    them, plural = ("them", True) if len(shown) > 1 else ("it", False)
    if any(c.get("created") for c in carried):
        fields, tuple_ = ", ".join(f"{n}=None" for n in shown), ", ".join(shown)
        loop_tuple = ", ".join(f"loop.{n}" for n in shown)
        return Diagnosis(
            f"{head}, though the global RNG streams and the restored state agree",
            f"{names} {'exist' if plural else 'exists'} when step {d.step - 1} ends in the uninterrupted run, "
            f"and the loop reads {them} before it sets {them} (a batch fetched ahead, a value carried into the "
            f"next step); the resumed process makes {them} again after restore(), so the resume trains on "
            "something else (a batch fetched ahead: the one after it, and every later draw shifts)",
            f"save {them} with the step that made {them}: loop = unbroken.Vars({fields}); state['loop'] = loop "
            f"before ckpt.restore(state); after it, {tuple_} = ({loop_tuple}) if loop.{shown[0]} is not None "
            f"else (as now); and {loop_tuple} = {tuple_} before each ckpt.step(state) (docs/your-loop.md: "
            "batches drawn by the loop)",
            f"{names}: at the end of step {d.step - 1} in the uninterrupted run and read first by the loop; not "
            "yet made at restore() in the resumed process; different at the end of the step")
    c = carried[0]
    what = c["interrupted"] if c["interrupted"] == c["uninterrupted"] else \
        f"{c['interrupted']} after the resume, {c['uninterrupted']} in the uninterrupted run"
    n = c["name"]
    return Diagnosis(f"{head}, though the batch, the global RNG streams and the restored state agree",
                     f"a value the loop carries from step to step is not in the state: {names} ({what}) "
                     f"held another value at the start of step {d.step} than in the uninterrupted run; after "
                     "a resume it starts again from its initial value",
                     f"keep it in the state from before restore(): loop = unbroken.Vars({n}=<its first value>); "
                     f"state['loop'] = loop before ckpt.restore(state), and use loop.{n} where the loop used {n} (a "
                     "tensor is restored in place); or reset it where a resume can reproduce it (at each epoch's "
                     "start)",
                     f"the loop's variable{'s' if plural else ''} {names} {'differ' if plural else 'differs'} "
                     f"between the runs at the start of step {d.step}; the state as restored, the batch and the "
                     "RNG streams agree")
