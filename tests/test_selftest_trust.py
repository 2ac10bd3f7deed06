"""``unbroken selftest`` can be trusted: no false alarm for an exact script whose evaluation every K steps
draws from the global RNG (nor for one at an epoch's end, which a resume no longer skips); every "diverged"
names a cause the records back (the carried variable by name) or says plainly that it cannot tell, with the
values; the report says what the test did not cover."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from test_selftest import _one_thread, script, selftest  # noqa: F401 - the fixture applies here too
from unbroken.selftest.compare import Divergence, compare
from unbroken.selftest.diagnose import diagnose
from unbroken.selftest.plan import Interruption, targeted

RUN = ("--steps", "20", "--kills", "1", "--kinds", "sigkill", "--timeout", "120", "--json")


def test_an_evaluation_every_k_steps_is_no_false_alarm(tmp_path: Path) -> None:
    # an evaluation every 8 steps after ckpt.step(), a save every 4: the SIGKILL after step 8 resumes from the
    # checkpoint of step 8, taken before that evaluation (a plain DataLoader: its iterator draws a base seed
    # from the global torch RNG), so the resumed run does not redo it; the training draws nothing from that RNG
    code, out, err = selftest(*RUN, "--seed", "3", "--workdir", str(tmp_path / "w"), *script("eval_every_k_steps"))
    doc = json.loads(out)
    assert code == 0 and doc["verdict"] == "identical", (doc["diagnosis"], doc["divergence"], err)
    att = doc["attempts"]
    assert [a["started"] for a in att] == ["fresh start", "resumed from step 8", "resumed from step 16"], att
    # the random SIGKILL right after step 8's save, then the targeted one inside the next evaluation
    assert att[0]["ended"] == "killed after step 8"
    assert att[1]["plan"].startswith("SIGKILL during the work after step 8")
    assert att[1]["ended"] == "killed during the work after step 16"
    notes = "\n".join(doc["notes"])
    assert "after the resume at step 8, the work between steps 8 and 9 that reads other DataLoaders (an evaluation?) " \
           "served 0 batches; the uninterrupted run's served 2: the checkpoint of step 8 was taken before that work" \
           in notes
    assert "the torch CPU RNG differs from step 9 on (after the resume at step 8), but no step drew from it" in notes
    assert "epoch" not in notes  # no epoch ended: none is blamed
    assert any("no epoch of the training data ended within the 20 steps" in n for n in doc["not_covered"])


def test_an_evaluation_that_shifts_the_rng_the_training_draws_from_is_the_cause(tmp_path: Path) -> None:
    # the same script whose training draws from the global RNG (dropout): the skipped evaluation now matters
    code, out, err = selftest(*RUN, "--seed", "3", *script("eval_every_k_steps", "--dropout"))
    doc = json.loads(out)
    assert code == 1 and doc["verdict"] == "diverged", (doc, err)
    d, g = doc["divergence"], doc["diagnosis"]
    assert (d["segment"], d["resumed_from"], d["step"], d["components"][0]) == (1, 8, 9, "batch/rng/torch"), d
    assert set(d["agreeing"]) >= {"batch/indices", "batch/data", "data/position"}
    assert d["evidence"]["drew_before"]["torch"] == [True, False]  # drawn between steps 8 and 9 only uninterrupted
    assert d["evidence"]["side"] == [2, 0] and d["evidence"]["epoch_end"] == [False, False]
    assert g["known"] is True
    assert g["cause"].startswith("the work between steps 8 and 9 drew from the torch CPU RNG in the uninterrupted "
                                 "run (2 batches of another DataLoader (an evaluation?), 0 after the resume) but "
                                 "did not run after the resume at step 8: the checkpoint was taken before it"), g
    assert "epoch" not in g["cause"]  # the training data's epoch did not end there
    assert "DataLoader(eval_set, generator=torch.Generator())" in g["fix"]
    assert "iterator" not in g["cause"]  # not the diagnosis of code the script does not have


@pytest.mark.parametrize("args", [(), ("--dropout",)], ids=["no-dropout", "dropout"])
@pytest.mark.slow  # runs long: the whole suite, not the fast tier (docs/testing.md)
def test_an_evaluation_at_an_epochs_end_runs_after_a_resume_there(args: tuple[str, ...]) -> None:
    # 8 steps an epoch, a save every 4: the SIGKILL after step 8 resumes from the checkpoint of the epoch's last
    # step; the restored loader ends the epoch, so the loop runs that epoch's evaluation (and its draw from the
    # global torch RNG) as the uninterrupted run did: exact, even when the training draws from that RNG
    code, out, err = selftest(*RUN, "--seed", "3", *script("eval_between_epochs", *args))
    doc = json.loads(out)
    assert code == 0 and doc["verdict"] == "identical", (doc["diagnosis"], doc["divergence"], err)
    att = doc["attempts"]
    assert [a["started"] for a in att] == ["fresh start", "resumed from step 8", "resumed from step 16"], att
    assert att[0]["ended"] == "killed after step 8"  # the epoch's last step, saved
    assert att[1]["ended"] == "killed during the work after step 16"  # inside the next epoch's evaluation
    assert not any("served" in n or "differs from step" in n for n in doc["notes"]), doc["notes"]
    assert not any("epoch" in n for n in doc["not_covered"]), doc["not_covered"]  # epoch ends were covered


@pytest.mark.slow  # runs long: the whole suite, not the fast tier (docs/testing.md)
def test_a_hidden_state_carried_outside_the_state_is_named(tmp_path: Path) -> None:
    code, out, err = selftest("--steps", "20", "--kills", "1", "--kinds", "sigkill", "--seed", "1", "--timeout", "120",
                              *script("rnn_hidden"))
    assert code == 1, (out, err)
    assert "diverged step 6: state['optimizer']'s gradients before optimizer.step() differ after the resume at " \
           "step 5, though the batch, the global RNG streams and the restored state agree" in out
    assert "cause:  a value the loop carries from step to step is not in the state: `hidden` (a tensor (1, 8, 16) " \
           "float32) held another value at the start of step 6" in out
    assert "evidence: the loop's variable `hidden` differs between the runs at the start of step 6" in out
    assert "fix:    keep it in the state from before restore(): loop = unbroken.Vars(hidden=<its first value>); " \
        "state['loop'] = loop before ckpt.restore(state)" in out
    assert "values: the loss passed to ckpt.step(): 0." in out  # the first differing values, readable


@pytest.mark.slow  # runs long: the whole suite, not the fast tier (docs/testing.md)
def test_a_carried_value_the_records_cannot_see_is_a_plain_cannot_tell_with_the_values() -> None:
    # the same running mean as unsaved_accumulator, kept in an object's attribute: no plain variable differs,
    # so no cause can be backed by the records; the report says so and shows the first differing values
    code, out, err = selftest("--steps", "20", "--kills", "1", "--kinds", "sigkill", "--seed", "1", "--timeout", "120",
                              *script("unsaved_accumulator", "--attribute"))
    assert code == 1, (out, err)
    assert "diverged step 6: state['optimizer']'s gradients before optimizer.step() differ after the resume at step 5" \
        in out
    values = [x for x in out.splitlines() if x.startswith("  values: state['optimizer']'s gradients")]
    assert len(values) == 1 and "(uninterrupted), " in values[0] and values[0].endswith("(interrupted)"), out
    a, b = values[0].split(": ", 2)[2].replace(" (uninterrupted)", "").replace(" (interrupted)", "").split(", ")
    assert a != b
    cause = next(x for x in out.splitlines() if x.startswith("  cause:  "))
    assert cause.startswith("  cause:  cannot tell: the state as restored, the training batch and the global RNG "
                            "streams agree, no generator outside the state restarted, and no plain variable of the "
                            "loop differs at the start of the step"), cause
    assert cause.endswith(f"The first difference is state['optimizer']'s gradients before optimizer.step(): {a} in "
                          f"the uninterrupted run, {b} in the interrupted one"), cause
    assert "`running`" not in out and "`stats`" not in out  # no variable is blamed without evidence


def test_the_suggested_fix_for_the_hidden_state_is_identical_and_the_uncovered_epoch_end_is_said() -> None:
    code, out, err = selftest("--steps", "12", "--kills", "1", "--seed", "0", "--timeout", "120", "--json",
                              *script("rnn_hidden", "--saved"))
    doc = json.loads(out)
    assert code == 0 and doc["verdict"] == "identical", (doc["diagnosis"], err)
    assert [a["started"] for a in doc["attempts"]] == ["fresh start", "resumed from step 5"], doc["attempts"]
    assert any("no epoch of the training data ended within the 12 steps (an epoch is about 64 steps: use --steps "
               "above 64)" in n for n in doc["not_covered"]), doc["not_covered"]


def test_epoch_end_work_and_a_branch_never_reached_are_not_covered() -> None:
    code, out, err = selftest("--steps", "6", "--kills", "1", "--seed", "0", "--timeout", "120",
                              *script("eval_between_epochs"))
    assert code == 0, (out, err)
    assert "not covered: no epoch of the training data ended within the 6 steps (an epoch is about 8 steps: use " \
           "--steps above 8)" in err
    # the line that evaluates after each epoch never ran; evaluate() itself was never entered
    assert "not covered: lines of eval_between_epochs.py that never ran in the uninterrupted run's 6 steps: 41 at " \
           "module level `print(f\"epoch {loader.epoch}: accuracy {evaluate(model, eval_loader):.3f}\"" in err
    assert "not covered: interruptions of kind save were not tried" not in err  # sigkill brings kills in saves


# ------------------------------------------------------------------ in-process units (records made by hand)
def _rec(kind: str, step: int, seg: int = 0, resumed: int | None = None, **c: str) -> dict:
    return {"kind": kind, "step": step, "seg": seg, "resumed_from": resumed, "c": c, "e": {}}


def test_an_rng_stream_counts_only_where_a_step_draws_from_it() -> None:
    ref = [_rec("restore", 0, **{"rng/torch": "a"}), _rec("step", 1, **{"batch/rng/torch": "a", "rng/torch": "a",
                                                                        "m/parameters": "p1"}),
           _rec("step", 2, **{"batch/rng/torch": "b", "rng/torch": "b", "m/parameters": "p2"})]
    # the resumed process did not draw what the uninterrupted run drew between steps 1 and 2: no step draws it
    got = [_rec("restore", 0, **{"rng/torch": "a"}), _rec("step", 1, **{"batch/rng/torch": "a", "rng/torch": "a",
                                                                        "m/parameters": "p1"}),
           _rec("restore", 1, 1, 1, **{"rng/torch": "a", "m/parameters": "p1"}),
           _rec("step", 2, 1, 1, **{"batch/rng/torch": "a", "rng/torch": "a", "m/parameters": "p2"})]
    res = compare(ref, got, 2)
    assert res.divergence is None and res.missing_steps == []
    assert [(x["stream"], x["step"], x["resumed_from"]) for x in res.not_drawn] == [("torch", 2, 1)]
    # the same, but step 2 draws (dropout): the stream at its first batch is what it consumes
    ref[2]["c"]["rng/torch"], got[3]["c"]["rng/torch"] = "b2", "a2"
    d = compare(ref, got, 2).divergence
    assert d is not None and (d.step, d.differ[0]) == (2, "batch/rng/torch")
    assert d.evidence["drew_before"]["torch"] == [True, False]


def test_a_restore_is_checked_against_what_its_own_run_saved() -> None:
    # the interrupted run's torch RNG differs harmlessly (never drawn) from step 2 on; restoring step 3 must
    # be compared with what that run saved at step 3, not with the uninterrupted run's RNG
    ref = [_rec("restore", 0, **{"rng/torch": "a"})] + [_rec("step", s, **{"rng/torch": "b", "batch/rng/torch": "b"})
                                                         for s in (1, 2, 3, 4)]
    got = [_rec("restore", 0, **{"rng/torch": "a"}), _rec("step", 1, **{"rng/torch": "b", "batch/rng/torch": "b"}),
           _rec("restore", 1, 1, 1, **{"rng/torch": "b"}),
           _rec("step", 2, 1, 1, **{"rng/torch": "x", "batch/rng/torch": "x"}),
           _rec("step", 3, 1, 1, **{"rng/torch": "x", "batch/rng/torch": "x"}),
           _rec("restore", 3, 2, 3, **{"rng/torch": "x"}),
           _rec("step", 4, 2, 3, **{"rng/torch": "x", "batch/rng/torch": "x"})]
    res = compare(ref, got, 4)
    assert res.divergence is None, res.divergence
    got[5]["c"]["rng/torch"] = "y"  # not restored as saved
    d = compare(ref, got, 4).divergence
    assert d is not None and (d.kind, d.step, d.differ) == ("restore", 3, ["rng/torch"])
    assert "not restored" in diagnose(d).cause


def test_a_difference_no_evidence_explains_says_it_cannot_tell_with_the_values() -> None:
    d = Divergence(8, 1, "step", 7, ["model/parameters"], ["batch/indices", "batch/rng/torch"],
                   {"model/parameters": ("3f2a", "9b1c")}, [], None,
                   {"carried": [], "rng_not_drawn": [], "drew_before": {"torch": [False, False]}})
    g = diagnose(d)
    assert g.known is False
    assert g.cause.startswith("cannot tell: the state as restored, the training batch and the global RNG streams "
                              "agree, no generator outside the state restarted, and no plain variable of the loop")
    assert "The first difference is state['model']'s parameters: 3f2a in the uninterrupted run, 9b1c in the " \
           "interrupted one" in g.cause


def test_an_iterator_made_before_restore_is_named_only_when_the_records_show_it() -> None:
    d = Divergence(6, 1, "step", 5, ["batch/indices"], ["data/position"], {"batch/indices": ("a", "b")},
                   evidence={"iterator": "before restore"})
    assert "iterator was created before restore()" in diagnose(d).cause
    d.evidence["iterator"] = "this step"  # created after restore(): that cause is ruled out
    g = diagnose(d)
    assert g.known is False and "iterator was created before restore()" not in g.cause
    assert g.cause.startswith("cannot tell: the data position was restored")


def test_an_rng_that_differed_undrawn_since_an_earlier_resume_is_traced_back() -> None:
    since = {"stream": "torch", "step": 9, "segment": 1, "resumed_from": 8, "drew_before": [True, False],
             "side": [2, 0], "epoch_end": [True, False]}
    d = Divergence(12, 1, "step", 8, ["batch/rng/torch", "model/parameters"], ["batch/indices"],
                   {"batch/rng/torch": ("a", "b")}, [], None,
                   {"drew_before": {"torch": [False, False]}, "previous": "step",
                    "rng_differs_since": {"torch": since}})
    g = diagnose(d)
    assert g.known and g.cause.startswith("the torch CPU RNG differs since step 9 (after the resume at step 8 (after "
                                          "the training data's epoch ended; 2 batches of another DataLoader")
    assert "step 12 is the first to draw from it" in g.cause


def test_the_skipped_work_is_said_to_follow_an_epoch_end_only_when_one_ended() -> None:
    ev = {"drew_before": {"torch": [True, False]}, "previous": "step", "side": [2, 0], "epoch_end": [False, False]}
    d = Divergence(9, 1, "step", 8, ["batch/rng/torch"], ["batch/indices"], {"batch/rng/torch": ("a", "b")}, [],
                   None, ev)
    g = diagnose(d)
    assert g.known and g.cause.startswith("the work between steps 8 and 9 drew from the torch CPU RNG in the "
                                          "uninterrupted run (2 batches of another DataLoader (an evaluation?), 0 "
                                          "after the resume) but did not run after the resume at step 8"), g.cause
    ev["epoch_end"] = [True, False]
    assert diagnose(d).cause.startswith("the work between steps 8 and 9 drew from the torch CPU RNG in the "
                                        "uninterrupted run (after the training data's epoch ended; 2 batches")


@pytest.mark.parametrize("kinds,expect", [
    (["sigkill", "sigterm"], [("sigkill", 3), ("sigterm", 8), ("between", 8)]),
    (["sigkill"], [("sigkill", 3), ("sigkill", 16), ("between", 8)]),  # no SIGTERM: a saved epoch end
    (["exception"], [("exception", 3)]),  # neither a SIGTERM nor a SIGKILL allowed: nothing added
])
def test_targeted_interruptions_at_an_epoch_end_and_inside_between_step_work(kinds: list[str], expect: list) -> None:
    plan = [Interruption(kinds[0], 3)]
    got = targeted(plan, kinds, epoch_ends=[8, 16], saved=[4, 12, 16], between=[8, 16])
    assert [(p.kind, p.step) for p in got] == sorted(expect, key=lambda x: (x[1], x[0] == "between"))
    # already covered: a SIGKILL at an epoch's last step that was saved resumes at the boundary
    assert targeted([Interruption("sigkill", 16)], ["sigkill"], [8, 16], [16], []) == [Interruption("sigkill", 16)]
    assert targeted([], ["sigterm"], [8], [8], [8]) == []  # --kills 0: nothing


@pytest.mark.slow  # runs long: the whole suite, not the fast tier (docs/testing.md)
def test_a_counted_loop_without_a_dataloader_has_its_epoch_ends_seen(tmp_path: Path) -> None:
    """``ckpt.batches(range(...))``, epochs of 6 steps: the epoch ends come from progress.epoch, so the report
    says neither that no DataLoader could be seen nor that no epoch ended (it said the first)."""
    code, out, err = selftest("--steps", "14", "--kills", "1", "--kinds", "sigkill", "--timeout", "120", "--json",
                              "--seed", "1", "--workdir", str(tmp_path / "w"), *script("counted_batches"))
    doc = json.loads(out)
    assert code == 0 and doc["verdict"] == "identical", (doc["diagnosis"], doc["divergence"], err)
    assert not any("DataLoader" in n or "no epoch" in n for n in doc["not_covered"]), doc["not_covered"]
