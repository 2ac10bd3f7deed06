"""Recovery after a process kill: a cold restart against ``unbroken run``'s warm spare, in one run.

The job is one training process (``WORKER`` below): ``bench_train_overhead.py``'s GPT-like model
(``--layers/--dim/--vocab/--seq/--batch``, 2/256/8192/64/4 by default: 5.8M parameters, ~70 MB of
parameters + AdamW moments, as ``bench_goodput.py``), AdamW, a ``ResumableLoader``, a save every
``--save-every`` (10) steps. It is SIGKILLed ``--kills`` (5) times, each time once the step after a save
is done and (for the warm configuration) the spare has imported, and restarted by:

* ``cold``: a plain restart loop (what ``torchrun --max-restarts`` or a ``while`` loop does): a new
  ``python worker.py`` each time (``unbroken run --cold``, the same supervisor without a spare);
* ``warm``: ``unbroken run -- python worker.py``: the spare becomes the training process; spares are forked
  from the supervisor's forker (``src/unbroken/launch/forker.py``);
* ``warm-exec``: the same with ``UNBROKEN_SPARES_FORK=0``: each spare a new interpreter that imports torch
  itself (right after a restart: beside the restored training).

Per kill: **restored** = from the kill to the worker's ``restore()`` returning (interpreter, imports,
model build, the checkpoint read), **first step** = to the first resumed step done (one step redone:
the kill comes after the step that follows a save), **10 steps** = from the restore to the 10th step after
it (what the replacement spare's start costs the training: the next kill waits for them), against the run's
first 10 steps. Medians; ``/ cold`` is the ratio. The final parameters of every run are compared with an
uninterrupted run's (exactness). ``--json F`` writes the numbers.

    python benchmarks/bench_warm_restart.py [--kills 5] [--save-every 10] [--json F]
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
WORKER = """
import time; T0 = time.time()
import hashlib, os, sys
sys.path.insert(0, {here!r})
import torch, unbroken
from unbroken.data import ResumableLoader
from bench_train_overhead import SyntheticTokens, TinyGPT
run, steps, out, every = sys.argv[1], int(sys.argv[2]), sys.argv[3], int(sys.argv[4])
layers, dim, vocab, seq, batch = (int(x) for x in sys.argv[5:10])
torch.set_num_threads(1)
torch.manual_seed(0)
model = TinyGPT(layers, dim, seq, vocab)
opt = torch.optim.AdamW(model.parameters(), lr=3e-4)
loader = ResumableLoader(SyntheticTokens(10_000, seq, vocab), batch_size=batch, shuffle=True, seed=0)
state = {{"model": model, "optimizer": opt, "data": loader}}
ckpt = unbroken.Checkpointer(run, save_every=every, keep_last=2)
ckpt.restore(state)
print("restored", ckpt.progress.step, time.time(), os.getpid(), flush=True)
batches = iter(loader)
while ckpt.progress.step < steps:
    try:
        b = next(batches)
    except StopIteration:
        batches = iter(loader); b = next(batches)
    x, y = b[:, :-1], b[:, 1:]
    loss = torch.nn.functional.cross_entropy(model(x).flatten(0, 1), y.flatten())
    loss.backward(); opt.step(); opt.zero_grad(set_to_none=True)
    ckpt.step(state)
    print("step", ckpt.progress.step, time.time(), flush=True)
ckpt.close()
h = hashlib.sha256()
for v in model.state_dict().values():
    h.update(v.detach().numpy().tobytes())
open(out, "w").write(h.hexdigest())
"""


CONFIGS = ("cold", "warm", "warm-exec")


def spare_ready(supervisor: int, training: int) -> bool:
    """Whether a spare of ``supervisor`` (its child, or its forker's) waits for its order (reads its pipe)."""
    parents: dict[int, int] = {}
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                parents[int(d.name)] = int((d / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):
                continue
    ours = {supervisor} | {p for p, parent in parents.items() if parent == supervisor}  # the forker among them
    for pid, parent in parents.items():
        if pid == training or parent not in ours:
            continue
        try:
            if b"unbroken.launch." not in Path(f"/proc/{pid}/cmdline").read_bytes():
                continue
            syscall = Path(f"/proc/{pid}/syscall").read_text().split()
            if "pipe" in Path(f"/proc/{pid}/wchan").read_text() or (syscall and syscall[0] == "0"):  # read(2)
                return True
        except OSError:
            continue
    return False


def job(tmp: Path, config: str, a: argparse.Namespace) -> dict:
    base = tmp / config
    base.mkdir()
    worker = base / "worker.py"
    worker.write_text(WORKER.format(here=str(HERE)))
    model = [str(getattr(a, k)) for k in ("layers", "dim", "vocab", "seq", "batch")]
    steps = (a.kills + 1) * a.save_every * 4
    cmd = [sys.executable, str(worker), str(base / "run"), str(steps), str(base / "final"), str(a.save_every), *model]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1",
               UNBROKEN_SPARES_FORK="0" if config == "warm-exec" else "1")
    if config == "reference":
        subprocess.run(cmd, check=True, capture_output=True, env=env, timeout=3600)
        return {"final": (base / "final").read_text()}
    sup = [sys.executable, "-m", "unbroken.cli", "run", "--max-restarts", str(a.kills + 1),
           *(["--cold"] if config == "cold" else []), "--"]
    proc = subprocess.Popen(sup + cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=env)
    assert proc.stdout is not None
    restored: list[float] = []
    first: list[float] = []
    ten: list[float] = []  # from a restore to the 10th step after it (the first: from the first start)
    killed_at: float | None = None
    kills_left, training, since, restored_at = a.kills, 0, 0, 0.0
    for line in proc.stdout:
        words = line.split()
        if words[0] == "restored":
            if killed_at is not None:
                restored.append(float(words[2]) - killed_at)
            training, since, restored_at = int(words[3]), int(words[1]), float(words[2])
        elif words[0] == "step":
            step, at = int(words[1]), float(words[2])
            if killed_at is not None and len(first) < len(restored):
                first.append(at - killed_at)
            if step == since + 10:
                ten.append(at - restored_at)
            settled = killed_at is None or len(first) == len(restored)
            if kills_left and step % a.save_every == 1 and step > since + 10 and settled:
                deadline = time.monotonic() + 300
                while config != "cold" and not spare_ready(proc.pid, training) and time.monotonic() < deadline:
                    time.sleep(0.02)
                killed_at = time.time()
                os.kill(training, signal.SIGKILL)
                kills_left -= 1
    proc.wait(timeout=600)
    return {"restored_s": restored, "first_step_s": first, "ten_steps_s": ten[1:], "first_ten_s": ten[:1],
            "status": proc.returncode, "final": (base / "final").read_text() if (base / "final").exists() else None}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    for k, v in (("layers", 2), ("dim", 256), ("vocab", 8192), ("seq", 64), ("batch", 4)):
        ap.add_argument(f"--{k}", type=int, default=v)
    ap.add_argument("--kills", type=int, default=5)
    ap.add_argument("--save-every", type=int, default=10)
    ap.add_argument("--json", metavar="FILE")
    a = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="unbroken-bench-warm-") as d:
        tmp = Path(d)
        results = {c: job(tmp, c, a) for c in ("reference", *CONFIGS)}
    ref = results["reference"]["final"]
    med = lambda xs: statistics.median(xs) if xs else None  # noqa: E731
    rows = []
    for c in CONFIGS:
        r = results[c]
        rows.append({"config": c, "kills": len(r["restored_s"]), "status": r["status"],
                     "restored_s": med(r["restored_s"]), "first_step_s": med(r["first_step_s"]),
                     "ten_steps_s": med(r["ten_steps_s"]), "first_ten_s": med(r["first_ten_s"]),
                     "exact": r["final"] == ref, "all_restored_s": r["restored_s"]})
    cold = rows[0]
    ratio = lambda r, k: r[k] / cold[k] if r[k] and cold[k] else None  # noqa: E731
    fmt = lambda x, f="{:.3f}": "-" if x is None else f.format(x)  # noqa: E731
    print(f"{'config':9}  {'kills':>5}  {'kill -> restored s':>18}  {'kill -> first step s':>20}  "
          f"{'10 steps after s (first 10)':>27}  exact")
    for r in rows:
        print(f"{r['config']:9}  {r['kills']:>5}  {fmt(r['restored_s']):>10} ({fmt(ratio(r, 'restored_s'), '{:.2f}x')})"
              f"  {fmt(r['first_step_s']):>12} ({fmt(ratio(r, 'first_step_s'), '{:.2f}x')})"
              f"  {fmt(r['ten_steps_s']):>19} ({fmt(r['first_ten_s'])})  {'yes' if r['exact'] else 'NO'}")
    if a.json:
        Path(a.json).write_text(json.dumps({"rows": rows, "args": vars(a),
                                            **{f"{r['config']}_over_cold_restored": ratio(r, "restored_s")
                                               for r in rows[1:]}}, indent=1))
    return 0 if all(r["exact"] and r["status"] == 0 for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
