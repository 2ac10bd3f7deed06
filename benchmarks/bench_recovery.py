"""Time to recover: from process start to the first resumed training step, phase by phase.

The run is ``bench_train_overhead.py``'s GPT-like model (same flags and defaults: 7.4M
parameters, ~88 MB of parameters + AdamW moments), its AdamW and its synthetic dataset of
10^6 token sequences through ``unbroken.data.ResumableLoader``. A setup subprocess makes a
checkpoint at step ``--resume-step`` (1000) of the first epoch: it trains 2 real steps (so
AdamW has its moments), moves the loader to the position of step 999 (``load_state_dict``
of a state with that position: O(1), exact) and ``ckpt.progress.step`` to 999, trains step
1000 for real and lets ``ckpt.step()`` save it (``Checkpointer(save_every=1000)``,
synchronous). The checkpoint holds what a 1000-step run's would (sizes, moments, data
position, RNGs) without 1000 steps of setup. The setup also ``torch.save``s the model's and
the optimizer's ``state_dict`` at that point (for the baseline), then trains step 1001 and
records its loss: every resumed run must reproduce it bit for bit.

Then ``--reps`` (3) rounds of two fresh subprocesses, each started after the page cache was
dropped (``sync; echo 3 > /proc/sys/vm/drop_caches``, root only; else the report says WARM
CACHE), so the interpreter, torch and the checkpoint all come from disk, as on a restarted
node. Phases, from wall-clock (``time.time()``) marks; the parent passes its launch time in
the environment:

* ``startup``: the parent's launch to this script's first line (fork, exec, interpreter, site).
* ``import``: the first line to ``import torch, unbroken`` and the model code done.
* ``build``: model (seeded init), AdamW and loader constructed. The first AdamW of a
  process imports ``torch._dynamo`` (~2 s here): a torch cost both sides pay.
* ``read``: ``Checkpointer(...)`` and ``restore()`` up to ``unbroken.checkpointer.restoring.apply_checkpoint``:
  the run's lock, finding the newest checkpoint, reading it, verifying every xxh3-128 checksum,
  decoding (``apply_checkpoint`` is wrapped in the child to split it).
* ``apply``: ``apply_checkpoint`` to the return of ``restore()``: ``load_state_dict`` of model,
  optimizer and loader, progress, RNGs, and the environment check (it fingerprints this
  process once: versions, git; shown separately as "of which environment").
* ``data``: from ``restore()``'s return to the first resumed batch in hand.
* ``first_step``: forward, backward and ``optimizer.step()`` of that batch (``loss.item()``).

The baseline subprocess does the same without unbroken: ``torch.load(weights_only=True)`` of
the ``torch.save``d file (``read``), ``load_state_dict`` of model and optimizer (``apply``),
and a plain ``DataLoader(shuffle=True)`` over the same dataset whose first 1000 batches are
loaded and discarded (``data``: replay, what a loop without a resumable loader does to get
back to its position; its order is another one). ``torch.set_num_threads(--threads)`` (2) in
every process. Medians over the reps.

    python benchmarks/bench_recovery.py [--quick] [--reps 3] [--resume-step 1000]
        [--layers 4 --dim 256 --seq 64 --batch 4 --vocab 8192] [--threads 2] [--dir D] [--json F] [--markdown F]

A default run takes ~1 min on 2 cores (a setup and 6 cold-started processes of ~7 s each);
``--quick`` (1 rep) ~25 s.
"""

from __future__ import annotations

import time

T_FIRST = time.time()  # this script's first line: the interpreter has started

import argparse  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import shutil  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

PHASES = ("startup", "import", "build", "read", "apply", "data", "first_step")
LABELS = {"startup": "interpreter start to first line", "import": "import torch, unbroken, model code",
          "build": "build model, AdamW, loader", "read": "read: find + verify + decode / torch.load",
          "apply": "apply: load_state_dict etc.", "data": "data: to the first resumed batch",
          "first_step": "first step (fwd + bwd + AdamW)", "total": "total: launch to first step done"}
MODEL_ARGS = ("layers", "dim", "seq", "batch", "vocab")


def setup(a: argparse.Namespace, run_dir: Path, pt: Path) -> dict[str, Any]:
    """Make the checkpoint at step ``--resume-step`` and the baseline's torch.save file."""
    import torch

    import unbroken
    from bench_train_overhead import build, state_bytes, train_step
    from unbroken.data import ResumableLoader

    torch.set_num_threads(a.threads)
    model, opt, ds = build(a.layers, a.dim, a.seq, a.vocab)
    loader = ResumableLoader(ds, batch_size=a.batch, shuffle=True, seed=0, num_workers=0)
    state = {"model": model, "optimizer": opt, "data": loader}
    ckpt = unbroken.Checkpointer(run_dir, save_every=a.resume_step, keep_last=2, preemption=None)
    it = iter(loader)
    for _ in range(2):  # real steps: AdamW state exists
        train_step(model, opt, next(it))
        ckpt.step(state)
    pos = (a.resume_step - 1) * a.batch  # jump to step resume_step - 1 (exact, O(1))
    loader.load_state_dict({**loader.state_dict(), "position": pos, "samples_seen": pos})
    ckpt.progress.step = a.resume_step - 1
    it = iter(loader)
    train_step(model, opt, next(it))
    info = ckpt.step(state)  # step resume_step: due, saved synchronously
    assert info is not None and info.step == a.resume_step, info
    torch.save({"model": model.state_dict(), "optimizer": opt.state_dict()}, pt)
    with open(pt, "rb") as f:
        os.fsync(f.fileno())
    ref_loss, _ = train_step(model, opt, next(it))  # step resume_step + 1: what every resume must compute
    ckpt.close()
    return {"ref_loss": ref_loss.item(), "state_bytes": state_bytes(model, opt), "checkpoint_bytes":
            sum(p.stat().st_size for p in Path(info.path).rglob("*") if p.is_file()), "pt_bytes": pt.stat().st_size}


def resume(a: argparse.Namespace, run_dir: Path, launch: float) -> dict[str, Any]:
    """A restarted training process: restore the newest checkpoint and take one step."""
    import torch

    import unbroken
    import unbroken.checkpointer.core
    import unbroken.checkpointer.restoring
    from bench_train_overhead import build, train_step
    from unbroken.data import ResumableLoader

    t = {"imported": time.time()}
    torch.set_num_threads(a.threads)
    model, opt, ds = build(a.layers, a.dim, a.seq, a.vocab)
    loader = ResumableLoader(ds, batch_size=a.batch, shuffle=True, seed=0, num_workers=0)
    state = {"model": model, "optimizer": opt, "data": loader}
    t["built"] = time.time()
    cls, env_s = unbroken.checkpointer.core.Core, [0.0]
    apply, environment = unbroken.checkpointer.restoring.apply_checkpoint, cls.environment

    def timed_apply(*args: Any, **kwargs: Any) -> Any:
        t["apply"] = time.time()  # everything before: lock, listing, read, verify, decode
        return apply(*args, **kwargs)

    def timed_environment(self: Any) -> dict[str, Any]:
        t0 = time.time()
        try:
            return environment(self)
        finally:
            env_s[0] += time.time() - t0

    unbroken.checkpointer.restoring.apply_checkpoint = timed_apply  # what restore() calls once the checkpoint is read
    cls.environment = timed_environment  # type: ignore[method-assign]
    ckpt = unbroken.Checkpointer(run_dir, save_every=a.resume_step, keep_last=2, preemption=None)
    info = ckpt.restore(state)
    t["restored"] = time.time()
    batch = next(iter(loader))
    t["batch"] = time.time()
    loss, _ = train_step(model, opt, batch)
    loss_v = loss.item()
    t["stepped"] = time.time()
    ckpt.close()
    assert info is not None and info.step == a.resume_step, f"resumed {info}, not step {a.resume_step}"
    return {"startup": T_FIRST - launch, "import": t["imported"] - T_FIRST, "build": t["built"] - t["imported"],
            "read": t["apply"] - t["built"], "apply": t["restored"] - t["apply"], "environment": env_s[0],
            "data": t["batch"] - t["restored"], "first_step": t["stepped"] - t["batch"],
            "total": t["stepped"] - launch, "loss": loss_v}


def baseline(a: argparse.Namespace, pt: Path, launch: float) -> dict[str, Any]:
    """The same restart with torch.load + load_state_dict + a replayed plain DataLoader."""
    import torch
    from torch.utils.data import DataLoader

    from bench_train_overhead import build, train_step

    t = {"imported": time.time()}
    torch.set_num_threads(a.threads)
    model, opt, ds = build(a.layers, a.dim, a.seq, a.vocab)
    t["built"] = time.time()
    sd = torch.load(pt, map_location="cpu", weights_only=True)
    t["read"] = time.time()
    model.load_state_dict(sd["model"])
    opt.load_state_dict(sd["optimizer"])
    t["applied"] = time.time()
    it = iter(DataLoader(ds, batch_size=a.batch, shuffle=True, generator=torch.Generator().manual_seed(0)))
    for _ in range(a.resume_step):  # replay: load and discard the batches already trained on
        next(it)
    batch = next(it)
    t["batch"] = time.time()
    loss, _ = train_step(model, opt, batch)
    loss.item()
    t["stepped"] = time.time()
    return {"startup": T_FIRST - launch, "import": t["imported"] - T_FIRST, "build": t["built"] - t["imported"],
            "read": t["read"] - t["built"], "apply": t["applied"] - t["read"], "data": t["batch"] - t["applied"],
            "first_step": t["stepped"] - t["batch"], "total": t["stepped"] - launch}


def drop_caches() -> bool:
    os.sync()
    try:
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
        return True
    except OSError:
        return False


def child(kind: str, tmp: Path, flags: list[str]) -> dict[str, Any]:
    """Run ``kind`` in a fresh process (page cache dropped first); its result is stdout's last line."""
    cold = drop_caches() if kind != "setup" else None
    launch = time.time()
    p = subprocess.run([sys.executable, __file__, "--child", kind, "--dir", str(tmp), *flags], check=False,
                       capture_output=True, text=True, env={**os.environ, "BENCH_LAUNCH": repr(launch)})
    if p.returncode:
        sys.exit(f"{kind} failed:\n{p.stderr}")
    return {"kind": kind, "cold": cold, **json.loads(p.stdout.strip().splitlines()[-1])}


def render(head: list[str], rows: list[list[str]], md: bool) -> str:
    if md:
        lines = ["| " + " | ".join(head) + " |", "|" + "|".join(["---"] + ["---:"] * (len(head) - 1)) + "|"]
        return "\n".join(lines + ["| " + " | ".join(r) + " |" for r in rows])
    w = [max(len(x) for x in col) for col in zip(head, *rows, strict=True)]
    fmt = lambda r: "  ".join(c.ljust(w[0]) if i == 0 else c.rjust(w[i]) for i, c in enumerate(r))  # noqa: E731
    return "\n".join([fmt(head), "  ".join("-" * x for x in w)] + [fmt(r) for r in rows])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    for k, v in zip(MODEL_ARGS, (4, 256, 64, 4, 8192), strict=True):
        ap.add_argument(f"--{k}", type=int, default=v, help=f"as in bench_train_overhead.py (default {v})")
    ap.add_argument("--resume-step", type=int, default=1000, help="the checkpoint's step (default 1000)")
    ap.add_argument("--reps", type=int, default=3, help="resumes (and baselines), round robin; medians (default 3)")
    ap.add_argument("--threads", type=int, default=2, help="torch.set_num_threads in every process (default 2)")
    ap.add_argument("--quick", action="store_true", help="smoke run: --reps 1")
    ap.add_argument("--dir", help="where to save (default: the temp dir if on the repo's filesystem, else the repo)")
    ap.add_argument("--json", metavar="FILE", help="also write the results as one JSON object")
    ap.add_argument("--markdown", metavar="FILE", help="also write the report as markdown")
    ap.add_argument("--child", choices=("setup", "resume", "baseline"), help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.quick:
        a.reps = 1
    if a.resume_step < 3:
        ap.error("--resume-step must be at least 3 (the setup trains 2 real steps first)")
    if a.child:
        d, launch = Path(a.dir), float(os.environ.get("BENCH_LAUNCH", T_FIRST))
        res = (setup(a, d / "run", d / "baseline.pt") if a.child == "setup" else
               resume(a, d / "run", launch) if a.child == "resume" else baseline(a, d / "baseline.pt", launch))
        print(json.dumps(res))
        return
    repo, tmpdir = Path(__file__).resolve().parents[1], tempfile.gettempdir()
    base = a.dir or (tmpdir if os.stat(tmpdir).st_dev == os.stat(repo).st_dev else str(repo))
    tmp = Path(tempfile.mkdtemp(prefix="unbroken-bench-recovery-", dir=base))
    flags = [f"--{k}={getattr(a, k)}" for k in MODEL_ARGS] + [f"--resume-step={a.resume_step}",
                                                               f"--threads={a.threads}"]
    started, runs, loadavg = time.perf_counter(), [], []
    try:
        print("[setup] checkpoint at step", a.resume_step, file=sys.stderr, flush=True)
        made = child("setup", tmp, flags)
        for rep in range(a.reps):
            for kind in ("resume", "baseline"):
                print(f"[run {rep + 1}/{a.reps}] {kind}", file=sys.stderr, flush=True)
                loadavg.append(float(Path("/proc/loadavg").read_text().split()[0]))
                runs.append({"rep": rep, **child(kind, tmp, flags)})
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    bad = [r["loss"] for r in runs if r["kind"] == "resume" and r["loss"] != made["ref_loss"]]
    if bad:
        sys.exit(f"NOT EXACT: resumed first-step losses {bad} != the uninterrupted run's {made['ref_loss']!r}")
    med = {k: {p: statistics.median(r[p] for r in runs if r["kind"] == k) for p in (*PHASES, "total")}
           for k in ("resume", "baseline")}
    env_s = statistics.median(r["environment"] for r in runs if r["kind"] == "resume")
    cold = all(r["cold"] for r in runs)
    rows = [[LABELS[p], f"{med['resume'][p]:.3f}", f"{med['baseline'][p]:.3f}"] for p in (*PHASES, "total")]
    rows.insert(PHASES.index("apply") + 1, ["  of which environment fingerprint", f"{env_s:.3f}", "-"])
    head = ["phase", "unbroken s", "baseline s (torch.load + replay)"]
    from bench_train_overhead import machine
    info = machine(Path(base))
    mb = {k: made[k] / 1e6 for k in ("state_bytes", "checkpoint_bytes", "pt_bytes")}
    title = (f"Resume at step {a.resume_step} (sample {a.resume_step * a.batch:,} of 10^6): state "
             f"{mb['state_bytes']:.1f} MB (params + AdamW moments; checkpoint {mb['checkpoint_bytes']:.1f} MB on "
             f"disk, torch.save file {mb['pt_bytes']:.1f} MB); model {a.layers} layers, dim {a.dim}, seq {a.seq}, "
             f"batch {a.batch}, vocab {a.vocab}; {a.threads} torch threads; median of {a.reps}; "
             + ("cold cache (dropped before every process)" if cold else "WARM CACHE (could not drop the page cache)")
             + f"; 1-min load average {min(loadavg):.1f}-{max(loadavg):.1f}; "
             f"took {time.perf_counter() - started:.0f} s.")
    exact = (f"Exactness: every resumed first step's loss equals the uninterrupted run's step {a.resume_step + 1} "
             f"({made['ref_loss']!r}). The baseline's data order is another one (a plain DataLoader).")
    raw = "\n".join(f"- {k}: total s {[round(r['total'], 3) for r in runs if r['kind'] == k]}, read s "
                    f"{[round(r['read'], 3) for r in runs if r['kind'] == k]}" for k in ("resume", "baseline"))
    print(f"{title}\nMachine: {info}\n\n{render(head, rows, md=False)}\n\n{exact}\n\nAll runs:\n{raw}")
    if a.json:
        doc: dict[str, Any] = {f"{p}_s": med["resume"][p] for p in (*PHASES, "total")}
        doc.update(environment_s=env_s, baseline_torch_load_s=med["baseline"]["read"],
                   baseline_replay_data_s=med["baseline"]["data"],
                   baseline={f"{p}_s": med["baseline"][p] for p in (*PHASES, "total")},
                   state_bytes=made["state_bytes"], checkpoint_bytes=made["checkpoint_bytes"],
                   resume_step=a.resume_step, reps=a.reps, threads=a.threads, cold_cache=cold,
                   first_step_loss=made["ref_loss"], exact=True, model={k: getattr(a, k) for k in MODEL_ARGS},
                   machine=info, runs=runs)
        Path(a.json).write_text(json.dumps(doc, indent=1) + "\n")
    if a.markdown:
        Path(a.markdown).write_text(f"{title}\n\nMachine: {info}\n\n{render(head, rows, md=True)}\n\n{exact}\n\n"
                                    f"All runs:\n\n{raw}\n")


if __name__ == "__main__":
    main()
