"""Bytes written and time per save: incremental checkpoints against full ones, LoRA-like fine-tuning.

The workload is the case incremental checkpoints are for (issue 16): a large frozen base and
small trainable adapters. The base is a residual stack of ``nn.Linear(--dim, --dim)`` layers
(``x = x + tanh(layer(x))``), ``--mb`` MB of fp32 weights and biases (600 by default), with
``requires_grad=False``; every layer gets a LoRA adapter (``A``: rank x dim, random; ``B``:
dim x rank, zeros; output ``base(x) + B(A(x))``) of rank ``--rank`` (dim / 200 by default:
about 1 % of the parameters), trained with AdamW (lr 1e-3, weight decay 0.01) over the
adapters only, on random inputs and targets (MSE), batch ``--batch``. The checkpointed state
is ``{"model": model, "optim": optimizer}`` (the frozen base included, as a plain
``model.state_dict()`` has it) plus unbroken's own RNG capture (``rng=True``, the default).

Two Checkpointers of the same training run, each in a fresh folder of the same filesystem:
``Checkpointer(dir, incremental=True, keep_last=None, save_every=None, preemption=None)`` and
the same with ``incremental=False`` (full checkpoints, the default). ``--saves`` (10) times:
``--steps`` (3) real optimizer steps (each followed by ``ckpt.step(state)`` on both, which only
counts the step: ``save_every=None``), then an explicit synchronous ``ckpt.save(state)`` into
each, timed with ``time.perf_counter``; the order of the two alternates from save to save.
The environment fingerprint (git state, versions) is taken before the first save, off the
clock (``ckpt.environment()``); save 1 still includes opening the run (writer lock, leftover
cleanup, chunk collection at start).

Measured per save:

* **bytes written**: from the filesystem, the total size (``st_size``) of the regular files in
  the run's subfolders (the checkpoint folders and ``chunks/``) after the save minus before.
  The run's top-level files (``index.sqlite``, ``.lock``) are bookkeeping, not checkpoints,
  and are left out; their growth over all saves is reported on its own. Allocated blocks
  (``st_blocks``) are reported too: small files take a whole 4 KB block each.
* **changed bytes**: the bytes of the model and optimizer tensors (``model.state_dict()`` and
  the optimizer's state) that changed since the previous save: every tensor is compared
  (``torch.equal``) with a clone taken at the previous save, and ``nbytes`` of those that
  differ are summed. At save 1 everything counts as changed. RNG states are not counted:
  they are overhead of the checkpoint, like the manifest and the chunk maps.
* the incremental save's own statistics (``ckpt.run.chunks.last``: chunk bytes written and
  reused), cross-checked against the bytes that appeared in ``chunks/``.

Reported: save 1 on its own (where an incremental save writes everything and hashes it with
SHA-256 too) and the medians over saves 2..``--saves``; the ratios incremental / full (bytes
and time) and bytes written / changed bytes, against the goal of issue 16: an incremental
save writes at most 1.1 x the changed bytes. Also, off the clock, the cost of hashing alone:
xxh3-128 over the whole state (what every incremental save does to find what changed) and
SHA-256 over the changed bytes (what it does to name the new chunks). At the end, the last
checkpoint of each run is loaded and every tensor compared with the live state.

    python benchmarks/bench_incremental.py [--mb 600 | --quick] [--saves 10] [--steps 3]
        [--dim 2048 --rank R --batch 16] [--dir D] [--json F] [--markdown F]

A default run (36 layers, 152 M parameters, a 622 MB state) takes 30-45 s on 2 idle cores,
half of it the ten full saves; ``--quick`` (8 MB base, dim 512, rank 3) under 10 s.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import platform
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import xxhash
from torch import nn

import unbroken

MODES = ("incremental", "full")


class LoRALinear(nn.Module):
    """A frozen ``nn.Linear`` plus a trainable low-rank update ``B @ A`` (B starts at zero)."""

    def __init__(self, dim: int, rank: int) -> None:
        super().__init__()
        self.base = nn.Linear(dim, dim)
        self.base.requires_grad_(False)
        self.lora_a = nn.Parameter(torch.randn(rank, dim) / math.sqrt(dim))
        self.lora_b = nn.Parameter(torch.zeros(dim, rank))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base(x) + (x @ self.lora_a.t()) @ self.lora_b.t()


class Net(nn.Module):
    def __init__(self, dim: int, rank: int, layers: int) -> None:
        super().__init__()
        self.layers = nn.ModuleList(LoRALinear(dim, rank) for _ in range(layers))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = x + torch.tanh(layer(x))
        return x


def build(mb: float, dim: int, rank: int, full: bool = False) -> tuple[Net, torch.optim.Optimizer]:
    torch.manual_seed(0)
    layers = max(1, round(mb * 1e6 / (4 * (dim * dim + dim))))
    model = Net(dim, rank, layers)
    if full:  # full fine-tuning: the base is trained too (the case incremental cannot help)
        model.requires_grad_(True)
    optim = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3, weight_decay=0.01)
    return model, optim


def train_step(model: Net, optim: torch.optim.Optimizer, dim: int, batch: int) -> float:
    x, target = torch.randn(batch, dim), torch.randn(batch, dim)
    loss = nn.functional.mse_loss(model(x), target)
    loss.backward()
    optim.step()
    optim.zero_grad(set_to_none=True)
    return loss.item()


def live_tensors(model: Net, optim: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    """Every tensor of the checkpointed model and optimizer state, by a flat name."""
    out = {f"model/{k}": v for k, v in model.state_dict().items()}
    for idx, st in optim.state_dict()["state"].items():
        out.update({f"optim/{idx}/{k}": v for k, v in st.items() if isinstance(v, torch.Tensor)})
    return out


def nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def changed_bytes(prev: dict[str, torch.Tensor] | None, cur: dict[str, torch.Tensor]) -> tuple[int, int]:
    """(bytes, count) of the tensors of ``cur`` that are new or differ from ``prev``."""
    size = count = 0
    for k, t in cur.items():
        p = None if prev is None else prev.get(k)
        if p is None or p.dtype != t.dtype or p.shape != t.shape or not torch.equal(p, t):
            size, count = size + nbytes(t), count + 1
    return size, count


def stored(run: Path) -> dict[str, int]:
    """Sizes of the files under ``run``: in its subfolders (checkpoints, ``chunks/``), split
    into chunks and the rest, with allocated blocks; and its top-level bookkeeping files."""
    out = {"bytes": 0, "chunk_bytes": 0, "alloc": 0, "files": 0, "top": 0}
    if not run.exists():
        return out
    for p in run.rglob("*"):
        if not p.is_file() or p.is_symlink():
            continue
        st = p.stat()
        if p.parent == run:
            out["top"] += st.st_size
            continue
        out["bytes"] += st.st_size
        out["alloc"] += st.st_blocks * 512
        out["files"] += 1
        if p.parent.name == "chunks":
            out["chunk_bytes"] += st.st_size
    return out


def hashing_cost(tensors: dict[str, torch.Tensor], changed: dict[str, torch.Tensor]) -> dict[str, float]:
    """Off the clock: xxh3-128 over every tensor, SHA-256 over the changed ones (seconds)."""
    from unbroken.format.tensorfile import raw_bytes
    t0 = time.perf_counter()
    for t in tensors.values():
        xxhash.xxh3_128(raw_bytes(t)).digest()
    t1 = time.perf_counter()
    for t in changed.values():
        hashlib.sha256(raw_bytes(t)).digest()
    t2 = time.perf_counter()
    t3 = time.perf_counter()
    for t in tensors.values():
        hashlib.sha256(raw_bytes(t)).digest()
    t4 = time.perf_counter()
    return {"xxh3_all_s": t1 - t0, "sha256_changed_s": t2 - t1, "sha256_all_s": t4 - t3}


def verify(path: Path, model: Net, optim: torch.optim.Optimizer) -> int:
    """Load the checkpoint at ``path``; every model and optimizer tensor must equal the live one."""
    got = unbroken.load(path)
    loaded = {f"model/{k}": v for k, v in got["model"].items()}
    for idx, st in got["optim"]["state"].items():
        loaded.update({f"optim/{idx}/{k}": v for k, v in st.items() if isinstance(v, torch.Tensor)})
    live = live_tensors(model, optim)
    assert loaded.keys() == live.keys(), f"{path}: loaded keys differ"
    bad = [k for k, t in live.items() if not (loaded[k].dtype == t.dtype and torch.equal(loaded[k], t))]
    assert not bad, f"{path}: {len(bad)} tensors differ, e.g. {bad[0]}"
    return len(live)


def machine(root: Path) -> str:
    cpu = next((ln.split(":", 1)[1].strip() for ln in Path("/proc/cpuinfo").read_text().splitlines()
                if ln.startswith("model name")), platform.processor())
    mem = int(re.search(r"MemTotal:\s+(\d+)", Path("/proc/meminfo").read_text()).group(1)) * 1024 / 1e9
    df = subprocess.run(["df", "-hT", str(root)], check=True, capture_output=True, text=True).stdout
    df = df.splitlines()[-1].split()
    return (f"{os.cpu_count()} cores ({cpu}), {mem:.0f} GB RAM; disk {df[0]} ({df[1]}, {df[2]}) mounted at {df[-1]}; "
            f"Linux {platform.release()}, Python {platform.python_version()}, torch {torch.__version__}, "
            f"xxhash {xxhash.VERSION}")


def human(n: float) -> str:
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if abs(n) >= scale:
            return f"{n / scale:.3g} {unit}" if abs(n) < 100 * scale else f"{n / scale:.0f} {unit}"
    return f"{n:.0f} B"


def render(head: list[str], rows: list[list[str]], md: bool) -> str:
    if md:
        lines = ["| " + " | ".join(head) + " |", "|" + "|".join(["---"] + ["---:"] * (len(head) - 1)) + "|"]
        return "\n".join(lines + ["| " + " | ".join(r) + " |" for r in rows])
    w = [max(len(x) for x in col) for col in zip(head, *rows, strict=True)]
    fmt = lambda r: "  ".join(c.ljust(w[0]) if i == 0 else c.rjust(w[i]) for i, c in enumerate(r))  # noqa: E731
    return "\n".join([fmt(head), "  ".join("-" * x for x in w)] + [fmt(r) for r in rows])


def run(args: argparse.Namespace, root: Path) -> dict:
    torch.set_num_threads(args.threads)
    model, optim = build(args.mb, args.dim, args.rank, args.full_finetune)
    state = {"model": model, "optim": optim}
    n_all = sum(p.numel() for p in model.parameters())
    n_train = sum(p.numel() for p in model.parameters() if p.requires_grad)
    ckpts = {m: unbroken.Checkpointer(root / m, incremental=m == "incremental", keep_last=None, save_every=None,
                                      preemption=None) for m in MODES}
    for c in ckpts.values():
        c.environment()  # git state and versions: once per process, off the clock
    per = {m: {k: [] for k in ("bytes", "alloc", "files", "chunk_bytes", "save_s")} for m in MODES}
    per["incremental"].update(stats_written=[], stats_reused=[])
    changed, changed_n, losses, hashing = [], [], [], None
    top0 = {m: stored(root / m)["top"] for m in MODES}
    prev: dict[str, torch.Tensor] | None = None
    try:
        for i in range(args.saves):
            for _ in range(args.steps):
                losses.append(train_step(model, optim, args.dim, args.batch))
                for c in ckpts.values():
                    c.step(state)
            cur = live_tensors(model, optim)
            size, n = changed_bytes(prev, cur)
            changed.append(size)
            changed_n.append(n)
            if i == 1:  # the hashes an incremental save does, alone, on a save with the usual changes
                diff = {k: t for k, t in cur.items() if not torch.equal(prev[k], t)}
                hashing = hashing_cost(cur, diff)
            prev = {k: t.detach().clone() for k, t in cur.items()}
            for m in (MODES if i % 2 == 0 else MODES[::-1]):  # alternate who saves first
                before = stored(root / m)
                t0 = time.perf_counter()
                ckpts[m].save(state)
                took = time.perf_counter() - t0
                after = stored(root / m)
                r = per[m]
                r["save_s"].append(took)
                for k in ("bytes", "alloc", "files", "chunk_bytes"):
                    r[k].append(after[k] - before[k])
                if m == "incremental":
                    st = ckpts[m].run.chunks.last
                    r["stats_written"].append(st.written_bytes)
                    r["stats_reused"].append(st.reused_bytes)
                    assert st.written_bytes == after["chunk_bytes"] - before["chunk_bytes"], \
                        f"save {i + 1}: SaveStats says {st.written_bytes} chunk bytes written, chunks/ grew by " \
                        f"{after['chunk_bytes'] - before['chunk_bytes']}"
            print(f"[save {i + 1}/{args.saves}] changed {human(size)}; " + "; ".join(
                f"{m} {human(per[m]['bytes'][-1])} in {per[m]['save_s'][-1]:.3f} s" for m in MODES),
                file=sys.stderr, flush=True)
        checked = {m: verify(Path(ckpts[m].latest().path), model, optim) for m in MODES}
        names = {m: sorted(p.name for p in (root / m).iterdir() if p.is_file()) for m in MODES}
        top = {m: stored(root / m)["top"] - top0[m] for m in MODES}
    finally:
        for c in ckpts.values():
            c.close()
    return {"per": per, "changed": changed, "changed_n": changed_n, "losses": losses, "hashing": hashing,
            "checked": checked, "top_files": names, "top_growth": top, "layers": len(model.layers),
            "params": n_all, "trainable": n_train, "tensors": len(prev),
            "state_bytes": sum(nbytes(t) for t in prev.values())}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mb", type=float, default=600.0, help="MB of frozen base weights (default 600)")
    ap.add_argument("--dim", type=int, default=2048, help="width of the linear layers (default 2048)")
    ap.add_argument("--rank", type=int, help="adapter rank (default: dim / 200, about 1 %% of the parameters)")
    ap.add_argument("--batch", type=int, default=16, help="batch size of the training steps (default 16)")
    ap.add_argument("--saves", type=int, default=10, help="saves per mode (default 10)")
    ap.add_argument("--steps", type=int, default=3, help="optimizer steps between saves (default 3)")
    ap.add_argument("--threads", type=int, default=2, help="torch threads (default 2)")
    ap.add_argument("--full-finetune", action="store_true",
                    help="train the base too (every tensor changes): the cost of incremental=True where it cannot help")
    ap.add_argument("--quick", action="store_true", help="smoke run: --mb 8 --dim 512 --rank 3 (a few seconds)")
    ap.add_argument("--dir", help="where to write (default: the temp dir if on the repo's filesystem, else the repo)")
    ap.add_argument("--markdown", metavar="FILE", help="also write the report as markdown")
    ap.add_argument("--json", metavar="FILE", help="also write the results as JSON (medians over saves 2..N, "
                    "save 1, per-save values, model and machine)")
    args = ap.parse_args()
    if args.quick:
        args.mb, args.dim, args.rank = 8.0, 512, args.rank or 3
    args.rank = args.rank or max(1, round(args.dim / 200))
    if args.saves < 2:
        ap.error("--saves: at least 2 (save 1 writes everything; the medians are over saves 2..N)")
    repo, tmpdir = Path(__file__).resolve().parents[1], tempfile.gettempdir()
    base = args.dir or (tmpdir if os.stat(tmpdir).st_dev == os.stat(repo).st_dev else str(repo))
    Path(base).mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix="unbroken-bench-incr-", dir=base))
    loadavg = float(Path("/proc/loadavg").read_text().split()[0])
    t_start = time.perf_counter()
    try:
        res = run(args, tmp)
        info = machine(tmp)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    wall = time.perf_counter() - t_start
    loadavg = (loadavg, float(Path("/proc/loadavg").read_text().split()[0]))

    med = statistics.median
    per, changed = res["per"], res["changed"]
    inc, full = per["incremental"], per["full"]
    later = slice(1, None)  # saves 2..N
    first = {"changed_bytes": changed[0], "bytes_incremental": inc["bytes"][0], "bytes_full": full["bytes"][0],
             "save_s_incremental": inc["save_s"][0], "save_s_full": full["save_s"][0]}
    m = {"changed_bytes_per_save": med(changed[later]), "bytes_per_save_incremental": med(inc["bytes"][later]),
         "bytes_per_save_full": med(full["bytes"][later]), "save_s_incremental": med(inc["save_s"][later]),
         "save_s_full": med(full["save_s"][later]), "chunk_bytes_per_save_incremental": med(inc["chunk_bytes"][later]),
         "alloc_per_save_incremental": med(inc["alloc"][later]), "alloc_per_save_full": med(full["alloc"][later])}
    # written beyond the changed tensors
    overhead = [b - c for b, c in zip(inc["bytes"][later], changed[later], strict=True)]
    # checkpoint folder: metadata
    meta = [b - c for b, c in zip(inc["bytes"][later], inc["chunk_bytes"][later], strict=True)]
    m["overhead_per_save_incremental"] = med(overhead)
    m["metadata_per_save_incremental"] = med(meta)

    n = args.saves
    head = ["", "save 1 (all new)", f"saves 2-{n}, median"]
    rows = [
        ["changed tensor bytes (model + optimizer)", human(first["changed_bytes"]), human(m["changed_bytes_per_save"])],
        ["incremental: bytes written", human(first["bytes_incremental"]), human(m["bytes_per_save_incremental"])],
        ["  of which chunks / checkpoint folder", f"{human(inc['chunk_bytes'][0])} / "
         f"{human(inc['bytes'][0] - inc['chunk_bytes'][0])}",
         f"{human(m['chunk_bytes_per_save_incremental'])} / {human(m['metadata_per_save_incremental'])}"],
        ["full: bytes written", human(first["bytes_full"]), human(m["bytes_per_save_full"])],
        ["incremental: save s", f"{first['save_s_incremental']:.3f}", f"{m['save_s_incremental']:.3f}"],
        ["full: save s", f"{first['save_s_full']:.3f}", f"{m['save_s_full']:.3f}"],
        ["bytes: incremental / full", f"{first['bytes_incremental'] / first['bytes_full']:.4f}",
         f"{m['bytes_per_save_incremental'] / m['bytes_per_save_full']:.4f}"],
        ["time: incremental / full", f"{first['save_s_incremental'] / first['save_s_full']:.2f}",
         f"{m['save_s_incremental'] / m['save_s_full']:.2f}"],
        ["incremental bytes written / changed bytes", f"{first['bytes_incremental'] / first['changed_bytes']:.4f}",
         f"{m['bytes_per_save_incremental'] / m['changed_bytes_per_save']:.4f}"],
        ["full bytes written / changed bytes", f"{first['bytes_full'] / first['changed_bytes']:.2f}",
         f"{m['bytes_per_save_full'] / m['changed_bytes_per_save']:.2f}"],
        ["allocated blocks: incremental / full", f"{human(inc['alloc'][0])} / {human(full['alloc'][0])}",
         f"{human(m['alloc_per_save_incremental'])} / {human(m['alloc_per_save_full'])}"],
    ]
    ratio = m["bytes_per_save_incremental"] / m["changed_bytes_per_save"]
    goal = {"goal": "incremental bytes written per save <= 1.1 x changed bytes (median, saves 2..N)",
            "ratio": ratio, "met": ratio <= 1.1}
    h = res["hashing"]
    title = (f"Model: {res['layers']} {'trained' if args.full_finetune else 'frozen'} "
             f"Linear({args.dim}, {args.dim}) layers + rank-{args.rank} LoRA adapters: "
             f"{res['params'] / 1e6:.1f} M parameters, {res['trainable'] / 1e6:.3f} M trainable "
             f"({100 * res['trainable'] / res['params']:.2f} %), AdamW over "
             f"{'everything' if args.full_finetune else 'the adapters'}; state "
             f"{human(res['state_bytes'])} in {res['tensors']} tensors (model + optimizer). {n} synchronous saves "
             f"per mode, {args.steps} optimizer steps before each; 1-min load average {loadavg[0]:.1f} / "
             f"{loadavg[1]:.1f} at start / end; whole run {wall:.0f} s.")
    top_files = ", ".join(sorted(set(res["top_files"]["incremental"]) | set(res["top_files"]["full"])))
    notes = (f"Bytes written: size of the files added under the run's checkpoint folders and chunks/ (the run's "
             f"top-level files {top_files}"
             f" are not counted; they grew by {human(res['top_growth']['incremental'])} (incremental) and "
             f"{human(res['top_growth']['full'])} (full) over all {n} saves). Incremental bytes beyond the changed "
             f"tensors, median: {human(m['overhead_per_save_incremental'])} per save (RNG states, manifest, "
             f"chunk maps, state.json; minus tensors with equal bytes stored once, e.g. the optimizer's step counts).\n"
             f"Hashing alone, off the clock, on save 2's state: xxh3-128 over the whole state {h['xxh3_all_s']:.3f} s, "
             f"SHA-256 over the changed tensors {h['sha256_changed_s']:.3f} s, SHA-256 over the whole state "
             f"{h['sha256_all_s']:.3f} s (what save 1 pays).\n"
             f"Checked: the last checkpoint of each run loaded, all {res['checked']['incremental']} tensors equal to "
             f"the live state. Losses: first {res['losses'][0]:.5f}, last {res['losses'][-1]:.5f}.")
    runs = "\n".join(f"- {k}: bytes {v['bytes']}, save s {[round(x, 3) for x in v['save_s']]}" for k, v in per.items())
    runs += f"\n- changed bytes: {changed} ({res['changed_n']} tensors)"
    runs += f"\n- incremental SaveStats written / reused bytes: {inc['stats_written']} / {inc['stats_reused']}"
    verdict = f"- {goal['goal']}: {goal['ratio']:.4f}" + (" (met)" if goal["met"] else " (NOT met)")
    print(f"{title}\nMachine: {info}\n\n{render(head, rows, md=False)}\n\nGoal:\n{verdict}\n\n{notes}\n\n"
          f"All saves:\n{runs}")
    if args.json:
        doc = {**m, "first_save": first, "goal": goal, "hashing": h, "machine": info,
               "model": {"layers": res["layers"], "dim": args.dim, "rank": args.rank, "params": res["params"],
                         "trainable": res["trainable"], "tensors": res["tensors"], "state_bytes": res["state_bytes"],
                         "mb": args.mb, "batch": args.batch, "steps_between_saves": args.steps},
               "saves": n, "medians_over": f"saves 2..{n}", "loadavg": loadavg, "wall_s": wall,
               "per_save": {"changed_bytes": changed, "changed_tensors": res["changed_n"],
                            **{f"{k}_{mode}": v for mode in MODES for k, v in per[mode].items()}},
               "top_level_growth": res["top_growth"]}
        Path(args.json).write_text(json.dumps(doc, indent=1) + "\n")
    if args.markdown:
        Path(args.markdown).write_text(f"{title}\n\nMachine: {info}\n\n{render(head, rows, md=True)}\n\nGoal:\n\n"
                                       f"{verdict}\n\n{notes.replace(chr(10), chr(10) * 2)}\n\nAll saves:\n\n{runs}\n")


if __name__ == "__main__":
    main()
