"""Save/load wall time and throughput of unbroken against the usual ways to checkpoint.

The state is shaped like a real one: a GPT-2-small-like ``state_dict`` of fp32
tensors (``--mb`` MB of parameters, 500 by default; the tied ``lm_head`` is left out)
plus, per parameter, an AdamW-like ``exp_avg``/``exp_avg_sq`` pair and a scalar
``step``: the whole state is ~3x ``--mb`` (~1.5 GB; ~150 MB with ``--quick``).
Tensors only, so that every method can store it.

Methods, SAVE / LOAD:

* ``raw disk``: ``os.write`` of the same bytes into one file + ``fsync`` /
  ``readinto`` one uninitialised buffer in 64 MB pieces + zero-copy views: the floor.
* ``torch``: ``torch.save`` + an explicit ``fsync`` of the file / ``torch.load(
  weights_only=True)``. ``torch.save`` never fsyncs by itself: the row "no fsync"
  times the same saves up to the return of ``torch.save`` (not durable yet).
* ``safetensors``: ``save_file`` (of the flattened dict) + ``fsync`` / ``load_file``.
* ``DCP``: ``torch.distributed.checkpoint.save``/``load``, one process, no process
  group (DCP then runs in its no-dist mode; its writer fsyncs). Load fills a state
  pre-allocated with ``empty_like`` (allocation included in the time).
* ``unbroken``: ``unbroken.save(path, state)`` (fsyncs every file and folder,
  xxh3-128 of every byte) / ``unbroken.load(path)`` (verifies the checksums first).
* ``unbroken_async``: a ``Checkpointer(async_save=True)`` save: ``stall s`` is how long the
  training loop is blocked (the copy into host buffers), ``save s`` runs until the
  background commit; the run is opened and the environment fingerprinted off the clock.
* ``unbroken_lazy``: the same with ``async_save="lazy"``: the tensors an optimizer steps are
  copied by the background thread, so ``stall s`` is the save point's work without the copy.
  The benchmark's state is plain tensors, so every tensor is declared optimizer-held (as in a
  model whose parameters are all trained with AdamW); the clock stops at the commit.

Every (run, method) pair is a fresh subprocess writing a fresh folder under
``--dir``; the runs go round robin over the methods, ``--reps`` times, and
medians are reported. Before every save and load the page cache
is dropped (``sync; echo 3 > /proc/sys/vm/drop_caches``, root only; otherwise the
report says "WARM CACHE"). A load ends once one byte of every page of every tensor
was read, so lazy (mmap-backed) loaders pay for their I/O too. Peak extra RSS is
VmHWM (reset via ``/proc/self/clear_refs``) minus VmRSS before the call, max over
reps; it counts file pages that mmap-based loaders map. Every load is checked: same
keys, every tensor ``torch.equal`` to the original.

    python benchmarks/bench_save_load.py [--mb 500 | --quick] [--reps 3] [--dir D] [--markdown F] [--json F]
"""

from __future__ import annotations

import argparse
import gc
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
import warnings
from pathlib import Path

import safetensors.torch
import torch
import torch.distributed.checkpoint as dcp

import unbroken


def gpt2_shapes(mb: float) -> list[tuple[str, tuple[int, ...]]]:
    """GPT-2-small layout (d=768, ctx 1024) scaled to ~``mb`` MB of fp32 parameters."""
    d, ctx, per_layer = 768, 1024, 12 * 768 * 768 + 13 * 768
    target = int(mb * 1e6 / 4)
    n_layer = max(1, round(12 * target / 124_439_808))  # GPT-2 small: 124.4M params in 12 layers
    vocab = max(256, (target - ctx * d - n_layer * per_layer - 2 * d) // d)
    layer = [("ln_1.weight", (d,)), ("ln_1.bias", (d,)), ("attn.c_attn.weight", (d, 3 * d)),
             ("attn.c_attn.bias", (3 * d,)), ("attn.c_proj.weight", (d, d)), ("attn.c_proj.bias", (d,)),
             ("ln_2.weight", (d,)), ("ln_2.bias", (d,)), ("mlp.c_fc.weight", (d, 4 * d)),
             ("mlp.c_fc.bias", (4 * d,)), ("mlp.c_proj.weight", (4 * d, d)), ("mlp.c_proj.bias", (d,))]
    shapes = [("transformer.wte.weight", (vocab, d)), ("transformer.wpe.weight", (ctx, d))]
    shapes += [(f"transformer.h.{i}.{n}", s) for i in range(n_layer) for n, s in layer]
    return shapes + [("transformer.ln_f.weight", (d,)), ("transformer.ln_f.bias", (d,))]


def build_state(mb: float) -> dict:
    g = torch.Generator().manual_seed(0)
    model, optim = {}, {}
    for name, shape in gpt2_shapes(mb):
        model[name] = torch.randn(shape, generator=g)
        optim[name] = {"step": torch.tensor(1000.0), "exp_avg": torch.randn(shape, generator=g),
                       "exp_avg_sq": torch.rand(shape, generator=g)}
    return {"model": model, "optim": optim}


def flatten(tree: dict, prefix: str = "") -> dict[str, torch.Tensor]:
    out = {}
    for k, v in tree.items():
        out.update(flatten(v, f"{prefix}{k}/") if isinstance(v, dict) else {f"{prefix}{k}": v})
    return out


def fsync_file(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


# Each save(state, out) may return the perf_counter() time at which the data was handed to
# the OS but not yet fsynced; each load(out, like) returns a (nested or flat) dict of tensors.

def save_raw(state, out):
    out.mkdir()
    fd = os.open(out / "raw.bin", os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        for t in flatten(state).values():
            mv, done = memoryview(t.reshape(-1).view(torch.uint8).numpy()), 0
            while done < len(mv):
                done += os.write(fd, mv[done:])
        os.fsync(fd)
    finally:
        os.close(fd)


def load_raw(out, like):
    with open(out / "raw.bin", "rb", buffering=0) as f:
        buf = torch.empty(os.fstat(f.fileno()).st_size, dtype=torch.uint8)  # not zero-filled
        view, got = memoryview(buf.numpy()), 0
        while got < len(view):
            got += f.readinto(view[got : got + (64 << 20)])
    loaded, off = {}, 0
    for k, t in flatten(like).items():
        n = t.numel() * t.element_size()
        loaded[k], off = buf[off : off + n].view(t.dtype).reshape(t.shape), off + n
    return loaded


def save_torch(state, out):
    out.mkdir()
    torch.save(state, out / "state.pt")
    mark = time.perf_counter()
    fsync_file(out / "state.pt")
    return mark


def save_safetensors(state, out):
    out.mkdir()
    safetensors.torch.save_file(flatten(state), str(out / "state.safetensors"))
    fsync_file(out / "state.safetensors")


def save_dcp(state, out):
    with warnings.catch_warnings():  # "torch.distributed is ... uninitialized, assuming ... a single process"
        warnings.simplefilter("ignore")
        dcp.save(state, checkpoint_id=str(out))


def load_dcp(out, like):
    def empty(x):
        return {k: empty(v) for k, v in x.items()} if isinstance(x, dict) else torch.empty_like(x)

    dest = empty(like)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.load(dest, checkpoint_id=str(out))
    return dest


def save_unbroken(state, out):
    unbroken.save(out, state)


PREPARED: dict = {}


def prepare_async(out, mode=True):
    """Outside the clock: open the run and take the environment fingerprint (git, versions)."""
    ckpt = unbroken.Checkpointer(out, async_save=mode, preemption=None, keep_last=None, rng=False)
    ckpt.environment()
    PREPARED["ckpt"] = ckpt


def all_optimizer_held(state):
    """For unbroken_lazy: every tensor of this plain-tensor state counts as optimizer-held."""
    from unbroken.checkpoint.snapshot import storage_key
    return frozenset(storage_key(t) for t in flatten(state).values() if t.numel())


def save_unbroken_async(state, out):
    """Returns when the training loop could go on (the stall); the clock stops at the commit."""
    ckpt = PREPARED.pop("ckpt")
    ckpt.save(state)
    stall = time.perf_counter()
    ckpt.flush()
    ckpt.close()
    return stall


def load_unbroken_run(out, like):
    return {k: v for k, v in unbroken.load(out / "step-000000000").items() if k != "__unbroken__"}


METHODS = {
    "raw": (save_raw, load_raw),
    "torch": (save_torch, lambda out, like: torch.load(out / "state.pt", map_location="cpu", weights_only=True)),
    "safetensors": (save_safetensors, lambda out, like: safetensors.torch.load_file(str(out / "state.safetensors"))),
    "dcp": (save_dcp, load_dcp),
    "unbroken": (save_unbroken, lambda out, like: unbroken.load(out)),
    "unbroken_async": (save_unbroken_async, load_unbroken_run),
    "unbroken_lazy": (save_unbroken_async, load_unbroken_run),
}
# the mark a save returns is when the loop could go on, not a no-fsync time
STALLS = {"unbroken_async", "unbroken_lazy"}


def proc_kib(key: str) -> int:
    return int(re.search(rf"^{key}:\s+(\d+) kB", Path("/proc/self/status").read_text(), re.MULTILINE).group(1))


def prepare_phase() -> tuple[bool, int]:
    """Drop the page cache (if allowed) and reset the peak-RSS mark; return (cold, rss_kib)."""
    os.sync()
    try:
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
        cold = True
    except OSError:
        cold = False
    gc.collect()
    try:
        Path("/proc/self/clear_refs").write_text("5\n")
    except OSError:
        pass  # old kernel: VmHWM then also holds earlier peaks
    return cold, proc_kib("VmRSS")


def run_child(name: str, mb: float, out: Path) -> dict:
    """One save and one load of ``name`` into the fresh folder ``out``, in this (fresh) process."""
    save, load = METHODS[name]
    state = build_state(mb)
    flat = flatten(state)
    res = {"nbytes": sum(t.numel() * t.element_size() for t in flat.values()), "ntensors": len(flat)}
    if name == "unbroken_async":
        prepare_async(out)
    if name == "unbroken_lazy":
        import unbroken.checkpointer.manager
        held = all_optimizer_held(state)
        unbroken.checkpointer.manager.step_only_storages = lambda s: held  # computed off the clock
        prepare_async(out, "lazy")
    cold, rss0 = prepare_phase()
    t0 = time.perf_counter()
    mark = save(state, out)
    res["save"] = time.perf_counter() - t0
    res["save_rss"] = (proc_kib("VmHWM") - rss0) * 1024
    res["save_nofsync"] = None if mark is None or name in STALLS else mark - t0
    res["stall"] = mark - t0 if name in STALLS else None
    res["disk_bytes"] = sum(p.stat().st_size for p in out.rglob("*") if p.is_file())
    cold2, rss0 = prepare_phase()
    t0 = time.perf_counter()
    loaded = flatten(load(out, state))
    for t in loaded.values():  # one byte per page: lazy loaders must do their reads now
        if t.numel():
            t.reshape(-1).view(torch.uint8)[::4096].sum()
    res["load"] = time.perf_counter() - t0
    res["load_rss"] = (proc_kib("VmHWM") - rss0) * 1024
    res["cold"] = cold and cold2
    assert loaded.keys() == flat.keys(), f"{name}: loaded keys differ"
    bad = [k for k, t in flat.items() if not (loaded[k].dtype == t.dtype and torch.equal(loaded[k], t))]
    assert not bad, f"{name}: {len(bad)} tensors differ, e.g. {bad[0]}"
    return res


ROWS = {"raw": "raw disk (os.write+fsync / readinto)", "torch": "torch.save+fsync / torch.load(weights_only)",
        "torch-nofsync": "torch.save, no fsync (not durable)", "safetensors": "safetensors save_file+fsync / load_file",
        "dcp": "DCP save / load (1 process)", "unbroken": "unbroken.save / unbroken.load (xxh3-128)",
        "unbroken_async": "unbroken async_save: until commit / load",
        "unbroken_lazy": "unbroken async_save='lazy': until commit / load"}


def machine(root: Path) -> str:
    import numpy
    import xxhash
    cpu = next((ln.split(":", 1)[1].strip() for ln in Path("/proc/cpuinfo").read_text().splitlines()
                if ln.startswith("model name")), platform.processor())
    mem = int(re.search(r"MemTotal:\s+(\d+)", Path("/proc/meminfo").read_text()).group(1)) * 1024 / 1e9
    df = subprocess.run(["df", "-hT", str(root)], check=True, capture_output=True, text=True).stdout
    df = df.splitlines()[-1].split()
    return (f"{os.cpu_count()} cores ({cpu}), {mem:.0f} GB RAM; disk {df[0]} ({df[1]}, {df[2]}) mounted at {df[-1]}; "
            f"Linux {platform.release()}, Python {platform.python_version()}, torch {torch.__version__}, "
            f"safetensors {safetensors.__version__}, xxhash {xxhash.VERSION}, numpy {numpy.__version__}")


def table(results: dict) -> tuple[list[str], list[list[str]]]:
    head = ["method", "save s", "save GB/s", "load s", "load GB/s", "save time / unbroken's",
            "load time / unbroken's", "peak extra RSS save / load MB", "stall s"]

    def med(name: str, phase: str) -> float:
        return statistics.median(results[name][phase])

    gb, ub_save, ub_load = results["unbroken"]["nbytes"] / 1e9, med("unbroken", "save"), med("unbroken", "load")
    rows = []
    for key, label in ROWS.items():
        name = key.removesuffix("-nofsync")
        if name not in results:
            continue
        if key.endswith("-nofsync"):
            s = med(name, "save_nofsync")
            rows.append([label, f"{s:.2f}", f"{gb / s:.2f}", "-", "-", f"{s / ub_save:.2f}", "-", "-", "-"])
            continue
        s, ld, r = med(name, "save"), med(name, "load"), results[name]
        rows.append([label, f"{s:.2f}", f"{gb / s:.2f}", f"{ld:.2f}", f"{gb / ld:.2f}", f"{s / ub_save:.2f}",
                     f"{ld / ub_load:.2f}", f"{max(r['save_rss']) / 1e6:.0f} / {max(r['load_rss']) / 1e6:.0f}",
                     f"{med(name, 'stall'):.3f}" if name in STALLS else "-"])
    return head, rows


def goals(results: dict) -> list[dict]:
    """The save/load goals, as ratios of medians, for the methods that ran."""
    med = lambda name, phase: statistics.median(results[name][phase])  # noqa: E731
    have, out = set(results), []

    def check(goal: str, ratio: float, at_least: float | None = None, at_most: float | None = None) -> None:
        met = None if at_least is None and at_most is None else \
            (at_least is None or ratio >= at_least) and (at_most is None or ratio <= at_most)
        out.append({"goal": goal, "ratio": ratio, "met": met})

    if {"unbroken_lazy", "torch"} <= have:
        check("lazy stall / (torch.save + fsync) <= 0.05", med("unbroken_lazy", "stall") / med("torch", "save"),
              at_most=0.05)
    if {"unbroken_async", "torch"} <= have:
        check("async stall / (torch.save + fsync) (no goal; for comparison)",
              med("unbroken_async", "stall") / med("torch", "save"))
    if "raw" in have:
        check("sync save speed / raw write+fsync speed >= 0.9", med("raw", "save") / med("unbroken", "save"),
              at_least=0.9)
        check("load speed / raw read speed >= 0.9", med("raw", "load") / med("unbroken", "load"), at_least=0.9)
    if "safetensors" in have:
        check("load speed / safetensors.load_file speed >= 1", med("safetensors", "load") / med("unbroken", "load"),
              at_least=1.0)
    return out


def render(head: list[str], rows: list[list[str]], md: bool) -> str:
    if md:
        lines = ["| " + " | ".join(head) + " |", "|" + "|".join(["---"] + ["---:"] * (len(head) - 1)) + "|"]
        return "\n".join(lines + ["| " + " | ".join(r) + " |" for r in rows])
    w = [max(len(x) for x in col) for col in zip(head, *rows, strict=True)]

    def fmt(r: list[str]) -> str:
        return "  ".join(c.ljust(w[0]) if i == 0 else c.rjust(w[i]) for i, c in enumerate(r))

    return "\n".join([fmt(head), "  ".join("-" * x for x in w)] + [fmt(r) for r in rows])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mb", type=float, default=500.0, help="MB of model parameters; the state is ~3x (default 500)")
    ap.add_argument("--quick", action="store_true", help="smoke run: --mb 50 (~150 MB state)")
    ap.add_argument("--reps", type=int, default=3, help="repetitions per method; medians are reported (default 3)")
    ap.add_argument("--dir", help="where to write (default: the temp dir if on the repo's filesystem, else the repo)")
    ap.add_argument("--markdown", metavar="FILE", help="also write the report as markdown")
    ap.add_argument("--json", metavar="FILE", help="also write the medians as JSON: per method save_s, load_s "
                    "(and stall_s for background saves), and state_bytes")
    ap.add_argument("--methods", default=",".join(METHODS), help="comma-separated subset; must include unbroken")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args()
    mb = 50.0 if args.quick else args.mb
    if "unbroken" not in args.methods.split(",") or not set(args.methods.split(",")) <= set(METHODS):
        ap.error(f"--methods: a subset of {','.join(METHODS)} that includes unbroken")
    if args.child:  # one method in its own process; the result is the last line of stdout
        print(json.dumps(run_child(args.child, mb, Path(args.dir))))
        return
    repo, tmpdir = Path(__file__).resolve().parents[1], tempfile.gettempdir()
    base = args.dir or (tmpdir if os.stat(tmpdir).st_dev == os.stat(repo).st_dev else str(repo))
    tmp = Path(tempfile.mkdtemp(prefix="unbroken-bench-", dir=base))
    loadavg, results = [], {}  # the 1-min load average before each child: other work on the machine skews times
    try:
        for rep in range(args.reps):  # round robin, so that slow phases of a noisy machine hit all methods
            for name in args.methods.split(","):
                print(f"[run {rep + 1}/{args.reps}] {name}", file=sys.stderr, flush=True)
                loadavg.append(float(Path("/proc/loadavg").read_text().split()[0]))
                out = tmp / f"{name}-{rep}"
                p = subprocess.run([sys.executable, __file__, "--child", name, "--mb", str(mb), "--dir", str(out)],
                                   check=False, capture_output=True, text=True)
                shutil.rmtree(out, ignore_errors=True)
                if p.returncode:
                    sys.exit(f"{name} failed:\n{p.stderr}")
                r = json.loads(p.stdout.strip().splitlines()[-1])
                phases = ("save", "save_nofsync", "load", "save_rss", "load_rss", "stall")
                agg = results.setdefault(name, {"cold": True, **{k: [] for k in phases}})
                for k in phases:
                    agg[k].append(r[k])
                agg.update(cold=agg["cold"] and r["cold"], nbytes=r["nbytes"], ntensors=r["ntensors"],
                           disk_bytes=r["disk_bytes"])
        info = machine(tmp)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    cache = "cold cache (dropped before every save and load)" if all(r["cold"] for r in results.values()) \
        else "WARM CACHE (could not drop the page cache: loads may be served from memory)"
    r0 = results["unbroken"]
    title = (f"State: {r0['nbytes'] / 1e9:.3f} GB in {r0['ntensors']} fp32 tensors (--mb {mb:g}); median of "
             f"{args.reps} runs; {cache}; 1-min load average {min(loadavg):.1f}-{max(loadavg):.1f} "
             f"during the run (other work on the machine slows everything).")
    runs = "\n".join(f"- {k}: save {[round(x, 2) for x in v['save']]}, load {[round(x, 2) for x in v['load']]}, "
                     f"{v['disk_bytes'] / 1e9:.3f} GB on disk" for k, v in results.items())
    head, rows = table(results)
    checks = goals(results)
    verdicts = "\n".join(f"- {g['goal']}: {g['ratio']:.3f}" + {True: " (met)", False: " (NOT met)", None: ""}[g["met"]]
                         for g in checks)
    print(f"{title}\nMachine: {info}\n\n{render(head, rows, md=False)}\n\nGoals (ratios of medians):\n"
          f"{verdicts}\n\nAll runs (s):\n{runs}")
    if args.json:
        med = statistics.median
        doc = {"state_bytes": r0["nbytes"], "machine": info, "reps": args.reps, "goals": checks}
        for k, v in results.items():
            doc[k] = {"save_s": med(v["save"]), "load_s": med(v["load"]), "state_bytes": v["nbytes"]}
            if k in STALLS:
                doc[k]["stall_s"] = med(v["stall"])
        Path(args.json).write_text(json.dumps(doc, indent=1) + "\n")
    if args.markdown:
        Path(args.markdown).write_text(f"{title}\n\nMachine: {info}\n\n{render(head, rows, md=True)}\n\n"
                                       f"Goals (ratios of medians):\n\n{verdicts}\n\nAll runs (s):\n\n{runs}\n")


if __name__ == "__main__":
    main()
