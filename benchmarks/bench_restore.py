"""Restore in a fresh process, imports split out: ``Checkpointer.restore`` against ``torch.load``.

The state is ``bench_train_overhead.py``'s GPT-like model (``--layers 4 --dim 384``: 13.4M
parameters) and its AdamW after two real steps (so it has its moments): ~161 MB of
parameters + moments. A setup subprocess saves it with a ``Checkpointer`` (one synchronous
save) and with ``torch.save`` of ``{"model": model.state_dict(), "optimizer": opt.state_dict()}``.

Then ``--reps`` (7) rounds, round robin, of three fresh subprocesses. Each imports what it
needs and builds a fresh model and AdamW (no state yet) **off the clock**, then times:

* ``unbroken``: ``import unbroken`` and the first ``unbroken.Checkpointer`` (its module, which
  imports torch-side code), then ``ckpt.restore(state)``: the **first** restore of the process
  (the run's lock, listing, reading and verifying every xxh3-128 checksum, decoding,
  ``load_state_dict`` of model and optimizer, the environment check; any import that lands
  inside it is counted here), then a **second** ``restore`` into another fresh model and
  AdamW in the same process (what is left once every lazy import is done). Also shown: how
  much of the first restore is reading (up to ``apply_checkpoint``) and the environment
  fingerprint.
* ``torch.load``: ``torch.load(weights_only=True, map_location="cpu")`` of the ``torch.save``
  file, alone and with ``load_state_dict`` of model and optimizer (what the restore does).
* ``raw read``: the checkpoint's files read into one fresh buffer (``readinto``, 16 MB at a
  time), the same bytes the restore reads: the floor for getting them into memory.

Every time is shown twice: wall clock, and the CPU time of the process (all its threads,
``time.process_time``), which a busy machine (other processes on the cores) disturbs much
less than the wall clock; the ratios of a CPU row are to the CPU time of ``torch.load`` and
of the raw read. ``--compare-src DIR`` adds the same ``unbroken`` process with another
version of the package first on its path (``git archive <commit> src | tar -x -C DIR/..``)
to the round robin: before and after a change, under the same load.

By default the files are in the page cache (each is read once before every subprocess): a
process restarted on the same node. ``--cold`` drops the page cache before every subprocess
instead (``sync; echo 3 > /proc/sys/vm/drop_caches``, root only). ``torch.set_num_threads``
(``--threads``, 2) in every process. Every restore is checked bitwise against the saved
state (after the clock). Medians over the reps; the ratios are of medians.

    python benchmarks/bench_restore.py [--reps 7] [--layers 4 --dim 384 --vocab 8192] [--cold]
        [--threads 2] [--compare-src DIR] [--dir D] [--json F] [--markdown F]

A default run takes 1-2 min on 2 cores (21 processes of 3-5 s, mostly ``import torch``).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

MODEL_ARGS = ("layers", "dim", "vocab")
SEQ = 64


def _flat(model: Any, opt: Any) -> dict[str, Any]:
    """Every tensor of the state, by a stable name (for the bitwise check)."""
    out = {f"model.{k}": v for k, v in model.state_dict().items()}
    for i, s in opt.state_dict()["state"].items():
        out.update({f"opt.{i}.{k}": v for k, v in s.items()})
    return out


def setup(a: argparse.Namespace, d: Path) -> dict[str, Any]:
    import torch

    import unbroken
    from bench_train_overhead import SyntheticTokens, build, state_bytes, train_step

    torch.set_num_threads(a.threads)
    model, opt, _ = build(a.layers, a.dim, SEQ, a.vocab)
    ds = SyntheticTokens(64, SEQ, a.vocab)
    for i in range(2):
        train_step(model, opt, torch.stack([ds[i * 4 + j] for j in range(4)]))
    ckpt = unbroken.Checkpointer(d / "run", keep_last=1, preemption=None)
    info = ckpt.save({"model": model, "optimizer": opt})
    ckpt.close()
    torch.save({"model": model.state_dict(), "optimizer": opt.state_dict()}, d / "state.pt")
    torch.save(_flat(model, opt), d / "expect.pt")
    files = sorted(p for p in Path(info.path).rglob("*") if p.is_file())
    (d / "files.json").write_text(json.dumps([str(p) for p in files]))
    return {"state_bytes": state_bytes(model, opt), "checkpoint_bytes": sum(p.stat().st_size for p in files),
            "pt_bytes": (d / "state.pt").stat().st_size}


def _same(d: Path, model: Any, opt: Any) -> bool:
    import torch

    want, have = torch.load(d / "expect.pt", weights_only=True), _flat(model, opt)
    return want.keys() == have.keys() and all(
        want[k].dtype == have[k].dtype and want[k].shape == have[k].shape and
        torch.equal(want[k].view(torch.uint8) if want[k].dim() else want[k], have[k].view(torch.uint8)
                    if have[k].dim() else have[k]) for k in want)


def child_unbroken(a: argparse.Namespace, d: Path) -> dict[str, Any]:
    import torch

    from bench_train_overhead import build

    torch.set_num_threads(a.threads)
    states = [build(a.layers, a.dim, SEQ, a.vocab)[:2] for _ in range(2)]
    t0 = time.perf_counter()
    import unbroken

    cls = unbroken.Checkpointer
    t1 = time.perf_counter()
    import unbroken.checkpointer.core as core
    import unbroken.checkpointer.restoring as restoring

    apply, environment, marks, env_s = restoring.apply_checkpoint, core.Core.environment, [], [0.0]

    def timed_apply(*args: Any, **kwargs: Any) -> Any:
        marks.append(time.perf_counter())
        return apply(*args, **kwargs)

    def timed_environment(self: Any) -> dict[str, Any]:
        t = time.perf_counter()
        try:
            return environment(self)
        finally:
            env_s[0] += time.perf_counter() - t

    restoring.apply_checkpoint = timed_apply
    core.Core.environment = timed_environment  # type: ignore[method-assign]
    t2 = time.perf_counter()
    ckpt = cls(d / "run", keep_last=1, preemption=None)
    out: dict[str, Any] = {"import_unbroken": t1 - t0, "construct": time.perf_counter() - t2}
    for i, (model, opt) in enumerate(states):
        t, c = time.perf_counter(), time.process_time()
        info = ckpt.restore({"model": model, "optimizer": opt})
        out[f"restore{i + 1}"], out[f"restore{i + 1}_cpu"] = time.perf_counter() - t, time.process_time() - c
        out[f"read{i + 1}"] = marks[-1] - t
        if i == 0:
            out["environment"] = env_s[0]
        assert info is not None
    ckpt.close()
    out["exact"] = all(_same(d, m, o) for m, o in states)
    return out


def child_torch(a: argparse.Namespace, d: Path) -> dict[str, Any]:
    import torch

    from bench_train_overhead import build

    torch.set_num_threads(a.threads)
    model, opt = build(a.layers, a.dim, SEQ, a.vocab)[:2]
    t0, c0 = time.perf_counter(), time.process_time()
    sd = torch.load(d / "state.pt", map_location="cpu", weights_only=True)
    t1, c1 = time.perf_counter(), time.process_time()
    model.load_state_dict(sd["model"])
    opt.load_state_dict(sd["optimizer"])
    t2, c2 = time.perf_counter(), time.process_time()
    return {"torch_load": t1 - t0, "torch_load_cpu": c1 - c0, "torch_load_apply": t2 - t0,
            "torch_load_apply_cpu": c2 - c0, "exact": _same(d, model, opt)}


def child_raw(a: argparse.Namespace, d: Path) -> dict[str, Any]:
    import torch

    files = [Path(p) for p in json.loads((d / "files.json").read_text())]
    t0, c0 = time.perf_counter(), time.process_time()
    buf = torch.empty(sum(p.stat().st_size for p in files), dtype=torch.uint8).numpy()
    view, at = memoryview(buf), 0
    for p in files:
        with open(p, "rb", buffering=0) as f:
            while n := f.readinto(view[at:at + 16 * 2**20]):
                at += n
    return {"raw_read": time.perf_counter() - t0, "raw_read_cpu": time.process_time() - c0, "exact": at == len(buf)}


def prepare(d: Path, cold: bool) -> bool | None:
    """Drop the page cache (``cold``; False if not allowed), or read every file once (warm)."""
    if cold:
        os.sync()
        try:
            Path("/proc/sys/vm/drop_caches").write_text("3\n")
            return True
        except OSError:
            return False
    for p in [*map(Path, json.loads((d / "files.json").read_text())), d / "state.pt"]:
        with open(p, "rb") as f:
            while f.read(1 << 24):
                pass
    return None


def child(kind: str, d: Path, flags: list[str], src: str | None = None) -> dict[str, Any]:
    """Run ``kind`` in a fresh process (with ``src`` first on its path: another unbroken)."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, (src, os.environ.get("PYTHONPATH"))))}
    p = subprocess.run([sys.executable, __file__, "--child", kind, "--dir", str(d), *flags], check=False,
                       capture_output=True, text=True, env=env)
    if p.returncode:
        sys.exit(f"{kind} failed:\n{p.stderr}")
    out = json.loads(p.stdout.strip().splitlines()[-1])
    return {("alt_" + k if src and k != "exact" else k): v for k, v in out.items()}


COLUMNS = (("restore1", "unbroken: first restore()"), ("restore2", "unbroken: second restore()"),
           ("read1", "  of the first: up to apply (lock, list, read, verify, decode)"),
           ("environment", "  of the first: waiting for the environment fingerprint"),
           ("import_unbroken", "import unbroken, unbroken.Checkpointer"), ("construct", "Checkpointer(...)"),
           ("torch_load", "torch.load"), ("torch_load_apply", "torch.load + load_state_dict"),
           ("raw_read", "raw read of the checkpoint's bytes"),
           ("restore1_cpu", "CPU s: first restore()"), ("torch_load_cpu", "CPU s: torch.load"),
           ("torch_load_apply_cpu", "CPU s: torch.load + load_state_dict"),
           ("raw_read_cpu", "CPU s: raw read"))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    for k, v in zip(MODEL_ARGS, (4, 384, 8192), strict=True):
        ap.add_argument(f"--{k}", type=int, default=v, help=f"as in bench_train_overhead.py (default {v})")
    ap.add_argument("--reps", type=int, default=7, help="rounds of the three processes; medians (default 7)")
    ap.add_argument("--threads", type=int, default=2, help="torch.set_num_threads in every process (default 2)")
    ap.add_argument("--cold", action="store_true", help="drop the page cache before every process (root only)")
    ap.add_argument("--dir", help="where to save (default: a temp dir)")
    ap.add_argument("--compare-src", metavar="DIR", help="also restore with the unbroken package in DIR (another "
                    "version's src/, e.g. from `git archive`), in the same round robin")
    ap.add_argument("--json", metavar="FILE", help="also write the results as one JSON object")
    ap.add_argument("--markdown", metavar="FILE", help="also write the table as markdown")
    ap.add_argument("--child", choices=("setup", "unbroken", "torch", "raw"), help=argparse.SUPPRESS)
    a = ap.parse_args()
    sys.path.insert(0, str(Path(__file__).parent))
    if a.child:
        d = Path(a.dir)
        fn = {"setup": setup, "unbroken": child_unbroken, "torch": child_torch, "raw": child_raw}[a.child]
        print(json.dumps(fn(a, d)))
        return
    tmp = Path(tempfile.mkdtemp(prefix="unbroken-bench-restore-", dir=a.dir))
    flags = [f"--{k}={getattr(a, k)}" for k in MODEL_ARGS] + [f"--threads={a.threads}"]
    started, runs, loadavg, cold = time.perf_counter(), [], [], []
    try:
        made = child("setup", tmp, flags)
        for rep in range(a.reps):
            for kind in ("unbroken", "torch", "raw") + (("compare",) if a.compare_src else ()):
                print(f"[run {rep + 1}/{a.reps}] {kind}", file=sys.stderr, flush=True)
                cold.append(prepare(tmp, a.cold))
                loadavg.append(float(Path("/proc/loadavg").read_text().split()[0]))
                src = a.compare_src if kind == "compare" else None
                runs.append({"kind": kind, **child("unbroken" if src else kind, tmp, flags, src)})
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    if not all(r["exact"] for r in runs):
        sys.exit(f"NOT EXACT: {[r for r in runs if not r['exact']]}")
    columns = COLUMNS + ((("alt_restore1", f"{a.compare_src}: first restore()"),
                          ("alt_restore2", f"{a.compare_src}: second restore()"),
                          ("alt_restore1_cpu", f"CPU s: {a.compare_src}: first restore()")) if a.compare_src else ())
    med = {k: statistics.median(r[k] for r in runs if k in r) for k, _ in columns}
    every = {k: [round(r[k], 3) for r in runs if k in r] for k, _ in columns}
    def base(k: str, of: str) -> float:
        return med[f"{of}_cpu"] if k.endswith("_cpu") else med[of]

    rows = [[label, f"{med[k]:.3f}", f"{med[k] / base(k, 'torch_load'):.2f}", f"{med[k] / base(k, 'raw_read'):.2f}",
             " ".join(f"{x:.3f}" for x in every[k])] for k, label in columns]
    head = ["in a fresh process", "median s", "/ torch.load", "/ raw read", "every run s"]
    from bench_train_overhead import machine, render
    how = ("cold cache (dropped before every process)" if all(cold) else
           "WARM CACHE (could not drop the page cache)" if a.cold else "files in the page cache")
    title = (f"Restore in a fresh process: state {made['state_bytes'] / 1e6:.1f} MB (params + AdamW moments; "
             f"checkpoint {made['checkpoint_bytes'] / 1e6:.1f} MB, torch.save file {made['pt_bytes'] / 1e6:.1f} MB); "
             f"model {a.layers} layers, dim {a.dim}, vocab {a.vocab}; {a.threads} torch threads; {how}; median of "
             f"{a.reps}; 1-min load average {min(loadavg):.1f}-{max(loadavg):.1f}; took "
             f"{time.perf_counter() - started:.0f} s. Every restore bitwise equal to the saved state.")
    print(f"{title}\nMachine: {machine(tmp.parent)}\n\n{render(head, rows, md=False)}")
    print(f"\nfirst restore / torch.load: {med['restore1'] / med['torch_load']:.2f} (CPU time "
          f"{med['restore1_cpu'] / med['torch_load_cpu']:.2f}); / raw read: {med['restore1'] / med['raw_read']:.2f}")
    if a.json:
        doc = {f"{k}_s": med[k] for k, _ in columns}
        doc.update(restore_over_torch_load=med["restore1"] / med["torch_load"],
                   restore_over_torch_load_cpu=med["restore1_cpu"] / med["torch_load_cpu"],
                   restore_over_raw_read=med["restore1"] / med["raw_read"], runs=runs, reps=a.reps,
                   cold_cache=bool(all(cold)), threads=a.threads, model={k: getattr(a, k) for k in MODEL_ARGS},
                   **{k: made[k] for k in ("state_bytes", "checkpoint_bytes", "pt_bytes")}, loadavg=loadavg)
        Path(a.json).write_text(json.dumps(doc, indent=1) + "\n")
    if a.markdown:
        Path(a.markdown).write_text(f"{title}\n\n{render(head, rows, md=True)}\n")


if __name__ == "__main__":
    main()
