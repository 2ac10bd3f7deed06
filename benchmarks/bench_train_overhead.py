"""Training throughput with checkpointing every ``--every`` steps: none vs sync vs async vs lazy.

The workload is a small GPT-like decoder-only transformer on the CPU: token + learned
positional embeddings, ``--layers`` pre-norm ``nn.TransformerEncoderLayer`` blocks (width
``--dim``, ``dim // 64`` heads, MLP 4x, dropout 0.1) run with a causal mask, a final
LayerNorm and an untied LM head over ``--vocab`` tokens; AdamW (lr 3e-4). Defaults: 4
layers, dim 256, vocab 8192, ``--seq`` 64, ``--batch`` 4: 7.4M parameters, a checkpointed
state (parameters + AdamW ``exp_avg``/``exp_avg_sq``) of ~88 MB, ~130-170 ms per step on
2 idle cores. The data is a deterministic synthetic dataset of 10^6 token sequences
(sample ``i`` is ``randint`` from a generator seeded with ``i``) read through
``unbroken.data.ResumableLoader(seed=0, num_workers=0)``, which is in the state under
``"data"`` with the model and the optimizer.

Configurations, each in a fresh subprocess:

* ``no_ckpt``: the bare loop, no Checkpointer.
* ``sync`` / ``async`` / ``lazy``: ``Checkpointer(dir, save_every=--every, keep_last=2,
  preemption=None, async_save=False | True | "lazy")`` and ``ckpt.step(state)`` after every
  ``optimizer.step()``. The background saves' tensor files are written by the writer process
  (:mod:`unbroken.checkpoint.background.filewriter`).
* ``async_thread`` / ``lazy_thread``: the same, written by the training process's background
  thread instead (``UNBROKEN_WRITER_PROCESS=0``, as before the writer process).
* ``dcp_async`` / ``dcp_async_process``: PyTorch DCP's ``async_save`` of the model's and the
  optimizer's state dicts every ``--every`` steps, with its thread or its background process
  (``benchmarks/overhead_dcp.py``; DCP writes no checksums, data position or RNG states).
* ``ram`` / ``ram_async`` / ``ram_lazy``: a save every step into a RAM tier, persisted every
  ``--every`` (see the README's RAM tier section).

Every run does ``--warmup`` (10) untimed steps, then ``--steps`` (200) timed steps: steps
11-210 with saves at steps 50, 100, 150 and 200 (4 saves). The timed window ends after a
final ``ckpt.flush()``, so a background save still in flight is paid for. The environment
fingerprint (git state, versions), which the first save computes once per process, is
taken before the clock starts (``ckpt.environment()``). ``torch.set_num_threads(--threads)``
(default 2) in every run, so all configurations compute the same floating-point sums;
unbroken's background writer thread shares the same cores with them.

Reported per configuration (median over ``--reps`` runs, which go round robin over the
configurations so that a noisy phase of the machine hits all of them): steps/s; overhead =
``time / no_ckpt's time - 1``; the median time of the steps that did not save (robust to
the spikes of a shared machine; shows a slowdown spread over all steps, e.g. the background
writer competing for the cores); the mean time of the 3 steps after each save, which run beside
its background write (the writer's interference with training); the stall per save = time inside the ``ckpt.step()``
calls that saved, divided by the saves; and the extra time of the ``optimizer.step()`` right after
a save over the median ``optimizer.step()`` (where ``lazy`` waits for its deferred copies);
and the **blocked overhead**: (stall + that wait) per save over the time of ``--every``
median ``no_ckpt`` steps, the share of the loop's time checkpointing blocks it, which other
work on a shared machine does not skew the way it skews steps/s (it leaves out any slowdown
of the other steps by the background writer: the median step times show that).
The model, dataset and step are shared with ``bench_recovery.py`` (``build``, ``train_step``).

Exactness, checked cheaply: the final loss (bit for bit) and a SHA-256 of all parameters of
every checkpointed run must equal ``no_ckpt``'s (checkpointing must not change training),
and the newest committed checkpoint must be the step of the last save.

    python benchmarks/bench_train_overhead.py [--quick] [--steps 200] [--every 50] [--reps 3]
        [--layers 4 --dim 256 --seq 64 --batch 4 --vocab 8192] [--threads 2] [--dir D] [--json F] [--markdown F]

A default run is 12 processes of ~7 s start (imports, model, first AdamW) + 210 steps:
~8 min on 2 idle cores, ~12 min on a busy pair; ``--quick`` (33 steps, save every 10, 1 rep)
~70 s. On a shared machine, other work shows up as spikes in the step times: compare the
median step time with steps/s, and use more ``--reps``.
"""

from __future__ import annotations

import argparse
import hashlib
import json
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
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import Dataset

CONFIGS: dict[str, Any] = {"no_ckpt": None, "sync": False, "async": True, "lazy": "lazy",
                           "async_thread": True, "lazy_thread": "lazy",
                           "ram": False, "ram_async": True, "ram_lazy": "lazy",
                           "dcp_async": "thread", "dcp_async_process": "process"}
DCP_CONFIGS = ("dcp_async", "dcp_async_process")
"""PyTorch DCP's ``async_save`` (its thread, and its background process): ``overhead_dcp.DcpAsync``."""
RAM_CONFIGS = ("ram", "ram_async", "ram_lazy")
THREAD_CONFIGS = ("async_thread", "lazy_thread")
"""Background saves written by the training process's background thread (``UNBROKEN_WRITER_PROCESS=0``),
as before the writer process: the others write from the writer process."""
AFTER = 3
"""Steps after each save timed as "during the write" (the background write runs beside them)."""
"""A RAM tier (``unbroken.RamTier(keep_last=2, persist_every=--every)``) and a save at *every* step."""
MODEL_ARGS = ("layers", "dim", "seq", "batch", "vocab")
MEDIANS = ("steps_per_s", "median_step_s", "stall_per_save_s", "next_step_wait_per_save_s", "saves", "opt_step_s",
           "during_write_step_s")


class SyntheticTokens(Dataset):
    """``n`` token sequences of length ``seq + 1``; sample ``i`` depends only on ``i``."""

    def __init__(self, n: int, seq: int, vocab: int) -> None:
        self.n, self.seq, self.vocab = n, seq, vocab

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> torch.Tensor:
        g = torch.Generator().manual_seed(int(i))
        return torch.randint(self.vocab, (self.seq + 1,), generator=g)


class TinyGPT(nn.Module):
    def __init__(self, layers: int, dim: int, seq: int, vocab: int) -> None:
        super().__init__()
        self.tok, self.pos = nn.Embedding(vocab, dim), nn.Embedding(seq, dim)
        block = nn.TransformerEncoderLayer(dim, max(1, dim // 64), 4 * dim, 0.1, batch_first=True, norm_first=True)
        self.blocks = nn.TransformerEncoder(block, layers, enable_nested_tensor=False)
        self.ln, self.head = nn.LayerNorm(dim), nn.Linear(dim, vocab, bias=False)
        self.register_buffer("mask", nn.Transformer.generate_square_subsequent_mask(seq), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        t = x.shape[1]
        h = self.tok(x) + self.pos.weight[:t]
        return self.head(self.ln(self.blocks(h, mask=self.mask[:t, :t], is_causal=True)))


def build(layers: int, dim: int, seq: int, vocab: int) -> tuple[TinyGPT, torch.optim.AdamW, SyntheticTokens]:
    """The model (seeded init), its AdamW and the dataset: shared with bench_recovery.py."""
    torch.manual_seed(0)
    model = TinyGPT(layers, dim, seq, vocab)
    return model, torch.optim.AdamW(model.parameters(), lr=3e-4), SyntheticTokens(10**6, seq, vocab)


def train_step(model: nn.Module, opt: torch.optim.Optimizer, batch: torch.Tensor) -> tuple[torch.Tensor, float]:
    """One optimizer step on ``batch``; returns the loss and the seconds ``opt.step()`` took."""
    logits = model(batch[:, :-1])
    loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), batch[:, 1:].reshape(-1))
    loss.backward()
    cuda = loss.is_cuda
    if cuda:
        torch.cuda.synchronize()
    t = time.perf_counter()
    opt.step()
    if cuda:
        torch.cuda.synchronize()
    took = time.perf_counter() - t
    opt.zero_grad(set_to_none=True)
    return loss.detach(), took


def state_bytes(model: nn.Module, opt: torch.optim.Optimizer) -> int:
    ts = list(model.parameters()) + [t for s in opt.state.values() for t in s.values() if torch.is_tensor(t)]
    return sum(t.numel() * t.element_size() for t in ts)


def params_sha256(model: nn.Module) -> str:
    h = hashlib.sha256()
    for p in model.parameters():
        h.update(p.detach().cpu().contiguous().numpy())
    return h.hexdigest()


def run_child(cfg: str, a: argparse.Namespace, out: Path) -> dict[str, Any]:
    """``--warmup`` + ``--steps`` steps of ``cfg`` in this (fresh) process."""
    import unbroken
    from unbroken.data import ResumableLoader

    torch.set_num_threads(a.threads)
    if a.device != "cpu":
        torch.use_deterministic_algorithms(True, warn_only=True)
    model, opt, ds = build(a.layers, a.dim, a.seq, a.vocab)
    model.to(a.device)
    loader = ResumableLoader(ds, batch_size=a.batch, shuffle=True, seed=0, num_workers=0)
    state = {"model": model, "optimizer": opt, "data": loader}
    ckpt = None
    ram = cfg in RAM_CONFIGS
    every = 1 if ram else a.every
    if cfg in DCP_CONFIGS:
        from overhead_dcp import DcpAsync

        ckpt = DcpAsync(out, every, CONFIGS[cfg])
    elif CONFIGS[cfg] is not None:
        tier = unbroken.RamTier(keep_last=2, persist_every=a.every, root=str(out / "shm")) if ram else None
        ckpt = unbroken.Checkpointer(out / "run", save_every=every, keep_last=2, preemption=None,
                                     async_save=CONFIGS[cfg], ram=tier)
        ckpt.environment()  # once per process (git, versions): off the clock
    it = iter(loader)
    stall, saves, last_save, after_save, opt_times, after_times, step_times = 0.0, 0, None, False, [], [], []
    during, since = [], AFTER + 1  # the steps right after a save (its background write runs beside them)
    t0 = time.perf_counter()
    for k in range(a.warmup + a.steps):
        if k == a.warmup:
            t0 = time.perf_counter()
        ts = time.perf_counter()
        loss, opt_took = train_step(model, opt, next(it).to(a.device))
        timed = k >= a.warmup
        if timed:
            (after_times if after_save else opt_times).append(opt_took)
        after_save = False
        if ckpt is not None:
            t = time.perf_counter()
            ckpt.step(state)
            if a.device != "cpu":  # what the training stream waited for, not only the CPU
                torch.cuda.synchronize()
            took = time.perf_counter() - t
            if ckpt.progress.step % every == 0:
                since = 0
                last_save, after_save = ckpt.progress.step, timed and not ram  # ram: every step saves
                if timed:
                    stall, saves = stall + took, saves + 1
                if not ram:
                    continue
        if timed:
            if a.device != "cpu":
                torch.cuda.synchronize()
            step_times.append(time.perf_counter() - ts)  # steps that did not save
            since += 1
            if since <= AFTER and not ram:
                during.append(step_times[-1])
    if ckpt is not None:
        ckpt.flush()  # a background save still in flight is part of the cost
    elapsed = time.perf_counter() - t0
    if ckpt is not None:
        newest = ckpt.latest()
        assert newest is not None and newest.step == last_save, f"{cfg}: newest {newest} is not step {last_save}"
        ckpt.close()
    base = statistics.median(opt_times)
    persist = {}
    if ram:  # what the writer process did: persisted checkpoints on disk, their copy times
        from unbroken.run.index.index import RunIndex

        done = RunIndex(out / "run").events("persisted")
        persist = {"persisted": len(done), "persist_s": statistics.median(e["data"]["took_s"] for e in done)}
    return {"config": cfg, "steps": a.steps, **persist, "elapsed_s": elapsed, "steps_per_s": a.steps / elapsed,
            "saves": saves, "stall_s": stall, "stall_per_save_s": stall / saves if saves else 0.0,
            "median_step_s": statistics.median(step_times), "opt_step_s": base,
            "during_write_step_s": statistics.mean(during) if during else statistics.median(step_times),
            "next_step_wait_per_save_s":
                sum(t - base for t in after_times) / len(after_times) if after_times else 0.0,
            "final_loss": loss.item(), "params_sha256": params_sha256(model), "state_bytes": state_bytes(model, opt)}


def machine(root: Path) -> str:
    cpu = next((ln.split(":", 1)[1].strip() for ln in Path("/proc/cpuinfo").read_text().splitlines()
                if ln.startswith("model name")), platform.processor())
    mem = int(re.search(r"MemTotal:\s+(\d+)", Path("/proc/meminfo").read_text()).group(1)) * 1024 / 1e9
    df = subprocess.run(["df", "-hT", str(root)], check=True, capture_output=True, text=True).stdout.splitlines()[-1]
    df = df.split()
    return (f"{os.cpu_count()} cores ({cpu}), {mem:.0f} GB RAM; disk {df[0]} ({df[1]}) mounted at {df[-1]}; "
            f"Linux {platform.release()}, Python {platform.python_version()}, torch {torch.__version__}")


def render(head: list[str], rows: list[list[str]], md: bool) -> str:
    if md:
        lines = ["| " + " | ".join(head) + " |", "|" + "|".join(["---"] + ["---:"] * (len(head) - 1)) + "|"]
        return "\n".join(lines + ["| " + " | ".join(r) + " |" for r in rows])
    w = [max(len(x) for x in col) for col in zip(head, *rows, strict=True)]
    fmt = lambda r: "  ".join(c.ljust(w[0]) if i == 0 else c.rjust(w[i]) for i, c in enumerate(r))  # noqa: E731
    return "\n".join([fmt(head), "  ".join("-" * x for x in w)] + [fmt(r) for r in rows])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--dim", type=int, default=256)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--steps", type=int, default=200, help="timed steps per run (default 200)")
    ap.add_argument("--warmup", type=int, default=10, help="untimed steps first (default 10)")
    ap.add_argument("--every", type=int, default=50, help="save every this many steps (default 50)")
    ap.add_argument("--reps", type=int, default=3, help="runs per configuration, round robin; medians (default 3)")
    ap.add_argument("--threads", type=int, default=2, help="torch.set_num_threads in every run (default 2)")
    ap.add_argument("--device", default="cpu", help="cpu (default) or cuda: the model and batches there, "
                    "deterministic algorithms, a synchronize after each step and each save (the stall is the GPU's)")
    ap.add_argument("--configs", default=",".join(CONFIGS), help="which configurations, comma-separated "
                    "(no_ckpt always runs; default: all)")
    ap.add_argument("--quick", action="store_true", help="smoke run: --steps 30 --warmup 3 --every 10 --reps 1")
    ap.add_argument("--dir", help="where to save (default: the temp dir if on the repo's filesystem, else the repo)")
    ap.add_argument("--json", metavar="FILE", help="also write the results as one JSON object")
    ap.add_argument("--markdown", metavar="FILE", help="also write the report as markdown")
    ap.add_argument("--child", choices=list(CONFIGS), help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.quick:
        a.steps, a.warmup, a.every, a.reps = 30, 3, 10, 1
    if (a.warmup + a.steps) // a.every <= a.warmup // a.every:
        ap.error("no save would fall in the timed steps: raise --steps or lower --every")
    wanted = ["no_ckpt", *(c for c in a.configs.split(",") if c in CONFIGS and c != "no_ckpt")]
    for c in list(CONFIGS):
        if c not in wanted and not a.child:
            del CONFIGS[c]
    if a.child:  # one configuration in its own process; the result is the last line of stdout
        print(json.dumps(run_child(a.child, a, Path(a.dir))))
        return
    repo, tmpdir = Path(__file__).resolve().parents[1], tempfile.gettempdir()
    base = a.dir or (tmpdir if os.stat(tmpdir).st_dev == os.stat(repo).st_dev else str(repo))
    tmp = Path(tempfile.mkdtemp(prefix="unbroken-bench-train-", dir=base))
    flags = [f"--{k}={getattr(a, k)}" for k in (*MODEL_ARGS, "steps", "warmup", "every", "threads", "device")]
    runs: list[dict[str, Any]] = []
    loadavg: list[float] = []
    started = time.perf_counter()
    try:
        for rep in range(a.reps):
            for cfg in CONFIGS:
                print(f"[run {rep + 1}/{a.reps}] {cfg}", file=sys.stderr, flush=True)
                loadavg.append(float(Path("/proc/loadavg").read_text().split()[0]))
                out = tmp / f"{cfg}-{rep}"
                env = dict(os.environ, UNBROKEN_WRITER_PROCESS="0" if cfg in THREAD_CONFIGS else "1")
                p = subprocess.run([sys.executable, __file__, "--child", cfg, "--dir", str(out), *flags],
                                   check=False, capture_output=True, text=True, env=env)
                shutil.rmtree(out, ignore_errors=True)
                if p.returncode:
                    sys.exit(f"{cfg} failed:\n{p.stderr}")
                runs.append({"rep": rep, **json.loads(p.stdout.strip().splitlines()[-1])})
        info = machine(tmp)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    ref = next(r for r in runs if r["config"] == "no_ckpt")
    for r in runs:  # exactness: checkpointing must not change a single bit of training
        if r["final_loss"] != ref["final_loss"] or r["params_sha256"] != ref["params_sha256"]:
            (print if a.device != "cpu" else sys.exit)(
                     f"NOT EXACT: {r['config']} (rep {r['rep']}) trained differently from no_ckpt: final loss "
                     f"{r['final_loss']!r} vs {ref['final_loss']!r}, parameters {r['params_sha256'][:16]} vs "
                     f"{ref['params_sha256'][:16]}")
    med = {c: {k: statistics.median(r[k] for r in runs if r["config"] == c)
               for k in MEDIANS} for c in CONFIGS}
    sps0 = med["no_ckpt"]["steps_per_s"]
    overhead = {c: (sps0 / med[c]["steps_per_s"] - 1) * 100 for c in CONFIGS}
    # blocked time per save (the stall plus the next step's extra wait) over the time of `every`
    # median no_ckpt steps: what checkpointing costs the loop, robust to other work on the machine
    step0 = med["no_ckpt"]["median_step_s"]
    # every step follows a save: the wait is the optimizer step's excess over no_ckpt's
    for c in (c for c in RAM_CONFIGS if c in CONFIGS):
        med[c]["next_step_wait_per_save_s"] = med[c]["opt_step_s"] - med["no_ckpt"]["opt_step_s"]
    blocked = {c: (max(0.0, med[c]["stall_per_save_s"]) + max(0.0, med[c]["next_step_wait_per_save_s"]))
               / ((1 if c in RAM_CONFIGS else a.every) * step0) * 100 for c in CONFIGS if c != "no_ckpt"}
    head = ["config", "steps/s", "overhead vs no_ckpt", "median step ms", f"{AFTER} steps after a save: mean ms",
            "saves", "stall / save s", "next opt.step wait / save s", "blocked overhead"]
    rows = [[c, f"{m['steps_per_s']:.3f}", "-" if c == "no_ckpt" else f"{overhead[c]:+.1f} %",
             f"{m['median_step_s'] * 1e3:.1f}", "-" if c == "no_ckpt" or c in RAM_CONFIGS else
             f"{m['during_write_step_s'] * 1e3:.1f}", "-" if c == "no_ckpt" else f"{m['saves']:.0f}",
             "-" if c == "no_ckpt" else f"{m['stall_per_save_s']:.3f}",
             "-" if c == "no_ckpt" else f"{m['next_step_wait_per_save_s']:+.3f}",
             "-" if c == "no_ckpt" else f"{blocked[c]:.2f} %"] for c, m in med.items()]
    title = (f"Model: {a.layers} layers, dim {a.dim}, seq {a.seq}, batch {a.batch}, vocab {a.vocab}; state "
             f"{ref['state_bytes'] / 1e6:.1f} MB (params + AdamW moments); {a.steps} timed steps after {a.warmup} "
             f"warm-up, save every {a.every}; {a.threads} torch threads; median of {a.reps} runs; 1-min load "
             f"average {min(loadavg):.1f}-{max(loadavg):.1f}; took {time.perf_counter() - started:.0f} s.")
    all_exact = all(r["final_loss"] == ref["final_loss"] and r["params_sha256"] == ref["params_sha256"] for r in runs)
    exact = (f"Exactness: every run's final loss {ref['final_loss']!r} and parameter SHA-256 "
             f"{ref['params_sha256'][:16]}... equal no_ckpt's ({len(runs)} runs)." if all_exact else
             "NOT EXACT: some runs trained differently from no_ckpt (see above; on a GPU, a kernel without a "
             "deterministic implementation does this to any two runs)")
    if min(overhead.values()) < -2:  # checkpointing cannot make training faster: other work skewed the runs
        exact += ("\nNOISY: a checkpointed configuration ran faster than no_ckpt, so other work on the machine "
                  "skewed the runs: trust the stall columns and the median step times, use more --reps.")
    raw = "\n".join(f"- {c}: steps/s {[round(r['steps_per_s'], 3) for r in runs if r['config'] == c]}, stall/save s "
                    f"{[round(r['stall_per_save_s'], 3) for r in runs if r['config'] == c]}" for c in CONFIGS)
    print(f"{title}\nMachine: {info}\n\n{render(head, rows, md=False)}\n\n{exact}\n\nAll runs:\n{raw}")
    if a.json:
        ckpts = [c for c in CONFIGS if c != "no_ckpt"]
        doc = {"steps_per_s_no_ckpt": sps0, "steps_per_s_ckpt": {c: med[c]["steps_per_s"] for c in ckpts},
               "overhead_pct": {c: overhead[c] for c in ckpts},
               "blocked_overhead_pct": blocked,
               "stall_per_save_s": {c: med[c]["stall_per_save_s"] for c in ckpts},
               "next_step_wait_per_save_s": {c: med[c]["next_step_wait_per_save_s"] for c in ckpts},
               "during_write_step_s": {c: med[c]["during_write_step_s"] for c in CONFIGS},
               "state_bytes": ref["state_bytes"], "every": a.every, "steps": a.steps, "warmup": a.warmup,
               "reps": a.reps, "threads": a.threads, "model": {k: getattr(a, k) for k in MODEL_ARGS},
               "final_loss": ref["final_loss"], "exact": all_exact, "device": a.device, "machine": info, "runs": runs}
        Path(a.json).write_text(json.dumps(doc, indent=1) + "\n")
    if a.markdown:
        Path(a.markdown).write_text(f"{title}\n\nMachine: {info}\n\n{render(head, rows, md=True)}\n\n{exact}\n\n"
                                    f"All runs:\n\n{raw}\n")


if __name__ == "__main__":
    main()
