"""Recovery after a process kill: a cold restart against ``unbroken run``'s warm spare, in one run.

The job is one training process (``WORKER`` below): ``bench_train_overhead.py``'s GPT-like model
(``--layers/--dim/--vocab/--seq/--batch``, 2/256/8192/64/4 by default: 5.8M parameters, ~70 MB of
parameters + AdamW moments, as ``bench_goodput.py``), AdamW, a ``ResumableLoader``, a save every
``--save-every`` (10) steps. It is SIGKILLed ``--kills`` (5) times, each time once the step after a save
is done and (for the warm configuration) the spare has imported, and restarted by:

* ``cold``: a plain restart loop (what ``torchrun --max-restarts`` or a ``while`` loop does): a new
  ``python worker.py`` each time (``unbroken run --cold``, the same supervisor without a spare);
* ``warm``: ``unbroken run -- python worker.py``: the spare becomes the training process.

Per kill: **restored** = from the kill to the worker's ``restore()`` returning (interpreter, imports,
model build, the checkpoint read), **first step** = to the first resumed step done (one step redone:
the kill comes after the step that follows a save). Medians; ``warm / cold`` is the ratio. The final
parameters of every run are compared with an uninterrupted run's (exactness). ``--json F`` writes the
numbers.

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


def spare_ready(supervisor: int, training: int) -> bool:
    for d in Path("/proc").iterdir():
        if not d.name.isdigit() or int(d.name) == training:
            continue
        try:
            ppid = int((d / "stat").read_text().rsplit(")", 1)[1].split()[1])
            if ppid == supervisor and b"unbroken.launch.spare" in (d / "cmdline").read_bytes():
                if "pipe" in (d / "wchan").read_text():
                    return True
        except (OSError, ValueError, IndexError):
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
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    if config == "reference":
        subprocess.run(cmd, check=True, capture_output=True, env=env, timeout=3600)
        return {"final": (base / "final").read_text()}
    sup = [sys.executable, "-m", "unbroken.cli", "run", "--max-restarts", str(a.kills + 1),
           *(["--cold"] if config == "cold" else []), "--"]
    proc = subprocess.Popen(sup + cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=env)
    assert proc.stdout is not None
    restored: list[float] = []
    first: list[float] = []
    killed_at: float | None = None
    kills_left, training = a.kills, 0
    for line in proc.stdout:
        words = line.split()
        if words[0] == "restored":
            if killed_at is not None:
                restored.append(float(words[2]) - killed_at)
            training = int(words[3])
        elif words[0] == "step":
            step, at = int(words[1]), float(words[2])
            if killed_at is not None and len(first) < len(restored):
                first.append(at - killed_at)
            settled = killed_at is None or len(first) == len(restored)
            if kills_left and step % a.save_every == 1 and step > 1 and settled:
                deadline = time.monotonic() + 300
                while config == "warm" and not spare_ready(proc.pid, training) and time.monotonic() < deadline:
                    time.sleep(0.02)
                killed_at = time.time()
                os.kill(training, signal.SIGKILL)
                kills_left -= 1
    proc.wait(timeout=600)
    return {"restored_s": restored, "first_step_s": first, "status": proc.returncode,
            "final": (base / "final").read_text() if (base / "final").exists() else None}


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
        results = {c: job(tmp, c, a) for c in ("reference", "cold", "warm")}
    ref = results["reference"]["final"]
    rows = []
    for c in ("cold", "warm"):
        r = results[c]
        rows.append({"config": c, "kills": len(r["restored_s"]), "status": r["status"],
                     "restored_s": statistics.median(r["restored_s"]) if r["restored_s"] else None,
                     "first_step_s": statistics.median(r["first_step_s"]) if r["first_step_s"] else None,
                     "exact": r["final"] == ref, "all_restored_s": r["restored_s"]})
    cold, warm = rows
    print(f"{'config':6}  {'kills':>5}  {'kill -> restored s':>18}  {'kill -> first step s':>20}  exact")
    for r in rows:
        print(f"{r['config']:6}  {r['kills']:>5}  {r['restored_s']:>18.3f}  {r['first_step_s']:>20.3f}  "
              f"{'yes' if r['exact'] else 'NO'}")
    ratio = warm["restored_s"] / cold["restored_s"] if cold["restored_s"] and warm["restored_s"] else None
    ratio_step = warm["first_step_s"] / cold["first_step_s"] if cold["first_step_s"] and warm["first_step_s"] else None
    print(f"warm / cold: restored {ratio:.3f}x, first step {ratio_step:.3f}x")
    if a.json:
        Path(a.json).write_text(json.dumps({"rows": rows, "warm_over_cold_restored": ratio,
                                            "warm_over_cold_first_step": ratio_step, "args": vars(a)}, indent=1))
    return 0 if all(r["exact"] and r["status"] == 0 for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
