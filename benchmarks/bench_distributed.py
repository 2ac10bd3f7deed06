"""Multi-rank save/load time: unbroken's ``Checkpointer`` against ``torch.distributed.checkpoint``.

The state is an FSDP2-sharded model (``fully_shard`` per layer on a CPU device mesh, gloo)
and its AdamW optimizer after one step: ``--layers`` (18) ``Linear(--dim, --dim)`` layers
of 2048 x 2048 fp32 with bias, ~302 MB of parameters, plus ``exp_avg``/``exp_avg_sq``
(DTensors, sharded like the parameters) and a scalar ``step`` per parameter (a plain
tensor, identical on every rank): ~906 MB in all, split evenly over the ranks.

For every world size in ``--worlds`` (2 and 4 by default) the script launches
``torchrun --standalone --nproc_per_node N`` on itself (``--worker``: one fresh process
group per world size). Every rank then runs, ``--reps`` times (3), round robin with the
order alternating between repetitions:

* ``unbroken`` SAVE: ``ckpt.save({"model": model, "optimizer": opt})`` with
  ``ckpt = unbroken.Checkpointer(run_dir, preemption=None, keep_last=None)``, created
  before the clock starts (it creates its gloo group), its environment fingerprint taken
  and its run opened (``ckpt.restore`` of the empty run) also before: those are once per
  process, not per save. The sharded tensors go through DCP's planners into one
  ``s<rank>.safetensors`` per rank, the ``step`` tensors are written once (round robin
  over the ranks), every file is checksummed (xxh3-128) and fsynced, the folders too,
  and rank 0 writes the manifest and renames the checkpoint into place.
* ``unbroken`` LOAD: a fresh model and optimizer, built, touched and given their (zero)
  optimizer state before the clock; a new ``Checkpointer`` on the same run (created before
  the clock, fingerprint taken); timed: ``ckpt.restore(state)``. It verifies every file
  (each rank a share: every ``world``-th file) and decodes the shared state, then loads the
  shards through ``dcp.load`` with unbroken's reader; replicated tensors through
  ``load_state_dict``.
* ``dcp`` SAVE: ``get_state_dict(model, opt)`` then ``dcp.save({"model": msd, "optim": osd},
  checkpoint_id=dir)``: the default ``FileSystemWriter`` (``sync_files=True``: it fsyncs
  each data file and ``.metadata``, not the folder; ``thread_count=1``; one
  ``__<rank>_0.distcp`` per rank; rank 0 writes the pickled ``.metadata``). No checksums.
* ``dcp`` LOAD: the same kind of fresh model and optimizer; timed: ``get_state_dict``,
  ``dcp.load`` and ``set_state_dict``.
* RESUME (both methods): the same as LOAD, but into a never-stepped optimizer, as a
  restarted job has: ``get_state_dict`` first gives it its state by running
  ``optimizer.step()`` on zero gradients (``_init_optim_state``); unbroken does the same
  for sharded (FSDP) optimizer state, and needs nothing of the kind for replicated state
  (``load_state_dict`` creates it).

``--cases``: ``fsdp`` (the above) and ``ddp``: the same layers in
``DistributedDataParallel``, every rank holding the whole model and optimizer state
(replicated: DCP deduplicates the write over the ranks; unbroken writes each of its
per-top-level-key files once, the files round robin over the ranks).

Both are durable when SAVE returns (DCP does not fsync the folder; unbroken does). One
untimed SAVE + LOAD of each method comes first (imports, DTensor sharding caches, gloo
groups): otherwise whichever runs first pays for them, reading Python modules from a
just-dropped page cache. The clock starts on every rank right after a barrier and stops when that rank's call
returns; the reported time is the maximum over the ranks. Before every save and every
load ``sync; echo 3 > /proc/sys/vm/drop_caches`` runs on rank 0 (between two barriers),
so loads read from the disk; without root the report says WARM CACHE. After every load
every rank checks, outside the clock, that each local shard (parameters, exp_avg,
exp_avg_sq, step) is bitwise what was saved (xxh3-64 of the bytes).

Per rank and measurement the worker records the wall time, the process CPU time, its minor
page faults (``getrusage``: first touches of fresh memory, pages of a mapped file), and
``/proc/self/io``: ``write_bytes``/``read_bytes`` (bytes this process sent to / read
from the block layer: its own file writes, and after a cache drop its disk reads) and
``wchar``/``rchar`` (bytes through read/write calls, page-cache hits included; unbroken
maps its tensor files, so its loads show none: per-rank load rates are given per byte of
state the rank holds). Rank 0 also lists each checkpoint's files and sizes. MB = 10^6 bytes.

    .venv/bin/python benchmarks/bench_distributed.py [--cases fsdp,ddp] [--worlds 2,4] \
        [--reps 3] [--layers 18 --dim 2048] [--dir DIR] [--json FILE] [--markdown FILE]

About 8 minutes with the defaults on 2 cores (about 4 with ``--cases fsdp``); needs
~2 GB free in ``--dir`` (the temporary folder by default) and ~8 GB of memory at 4 ranks
in the ddp case; everything written there is removed at the end. Run as root so that the
page cache can be dropped.
"""

from __future__ import annotations

import argparse
import functools
import gc
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path

METHODS = ("unbroken", "dcp")


# ============================================================================ worker
def io_counters() -> dict[str, int]:
    out = {}
    with open("/proc/self/io") as f:
        for line in f:
            k, v = line.split(":")
            out[k.strip()] = int(v)
    return out


def minor_faults() -> int:
    """Minor page faults of this process so far (first touches of fresh memory, mapped pages)."""
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def drop_caches() -> bool:
    os.sync()
    try:
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
        return True
    except OSError:
        return False


def build(case: str, layers: int, dim: int, fill: bool, seed: int):
    """The model and an AdamW optimizer. ``fsdp``: FSDP2 (per-layer ``fully_shard``), each rank
    holds 1/world of every parameter; ``ddp``: DistributedDataParallel, every rank holds the
    whole model. Parameters are materialised on CPU and written (random values if ``fill``,
    else zeros), so every page is touched before any clock starts."""
    import torch
    import torch.distributed as dist

    with torch.device("meta"):
        model = torch.nn.Sequential(*[torch.nn.Linear(dim, dim) for _ in range(layers)])
    if case == "fsdp":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (dist.get_world_size(),))
        for layer in model:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
    model.to_empty(device="cpu")
    g = torch.Generator().manual_seed(seed * 1000 + (dist.get_rank() if case == "fsdp" else 0))
    with torch.no_grad():
        for p in model.parameters():
            local = p.to_local() if hasattr(p, "to_local") else p
            if fill:
                local.copy_(torch.randn(local.shape, generator=g) * 0.02)
            else:
                local.zero_()
    if case == "ddp":
        model = torch.nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01)
    return model, opt


def one_step(model, opt) -> None:
    """One AdamW step with a gradient derived from the parameters (no forward/backward:
    that would all-gather the whole model over gloo for nothing the checkpoint needs)."""
    import torch

    with torch.no_grad():
        for p in model.parameters():
            p.grad = p.detach().clone() * 1e-3
    opt.step()
    opt.zero_grad(set_to_none=True)


def digests(model, opt) -> dict[str, str]:
    """xxh3-64 of the bytes of every local shard of the model and optimizer state."""
    import torch
    import xxhash
    from torch.distributed.checkpoint.state_dict import get_state_dict

    msd, osd = get_state_dict(model, opt)
    flat: dict[str, torch.Tensor] = {f"model/{k}": v for k, v in msd.items()}
    for fqn, st in osd["state"].items():
        for k, v in st.items():
            flat[f"optim/{fqn}/{k}"] = v
    out = {}
    for k, v in sorted(flat.items()):
        t = v.to_local() if hasattr(v, "to_local") else v
        t = t.detach().contiguous()
        out[k] = f"{t.dtype}:{tuple(t.shape)}:" + xxhash.xxh3_64_hexdigest(t.view(-1).view(torch.uint8).numpy())
    return out


def local_bytes(model, opt) -> int:
    n = 0
    for v in [*model.state_dict().values(), *(t for st in opt.state.values() for t in st.values())]:
        t = v.to_local() if hasattr(v, "to_local") else v
        n += t.numel() * t.element_size()
    return n


def worker(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import _init_optim_state, get_state_dict, set_state_dict

    import unbroken

    warnings.filterwarnings("ignore")
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(1)
    root = Path(args.dir)
    case = args.case

    model, opt = build(case, args.layers, args.dim, fill=True, seed=1)
    one_step(model, opt)
    expected = digests(model, opt)

    # once per process, reported apart: the environment fingerprint (git, versions), and the
    # optimizer-state initialisation that both loads pay into a never-stepped optimizer
    t0 = time.perf_counter()
    probe = unbroken.Checkpointer(root / "fingerprint-probe", preemption=None, keep_last=None)
    probe.environment()
    fingerprint_s = time.perf_counter() - t0
    probe.close()
    m2, o2 = build(case, args.layers, args.dim, fill=False, seed=2)
    dist.barrier()
    t0 = time.perf_counter()
    _init_optim_state(o2)
    init_optim_s = time.perf_counter() - t0
    del m2, o2

    cold = True

    def prepare(drop: bool) -> None:
        nonlocal cold
        dist.barrier()
        if rank == 0:
            if drop:
                cold = drop_caches() and cold
            else:
                os.sync()
        dist.barrier()

    def measure(fn) -> dict:
        dist.barrier()
        io0, c0, f0, t0 = io_counters(), time.process_time(), minor_faults(), time.perf_counter()
        fn()
        t1, c1, f1, io1 = time.perf_counter(), time.process_time(), minor_faults(), io_counters()
        return {"s": t1 - t0, "cpu_s": c1 - c0, "minflt": f1 - f0,
                **{k: io1[k] - io0[k] for k in ("write_bytes", "read_bytes", "wchar", "rchar")}}

    def one(method: str, where: Path, drop: bool) -> dict:
        """SAVE then LOAD (into a fresh model and optimizer) with ``method``; checked."""
        rec: dict = {"method": method, "rank": rank}
        if method == "unbroken":
            ckpt = unbroken.Checkpointer(where, preemption=None, keep_last=None)
            ckpt.environment()
            assert ckpt.restore({"model": model, "optimizer": opt}) is None  # opens the (empty) run
            prepare(drop)
            rec["save"] = measure(lambda: ckpt.save({"model": model, "optimizer": opt}))
            ckpt.close()
            ckpt_dir = next(p for p in where.iterdir() if p.name.startswith("step-"))
        else:
            def save_dcp() -> None:
                msd, osd = get_state_dict(model, opt)
                dcp.save({"model": msd, "optim": osd}, checkpoint_id=str(where))
            prepare(drop)
            rec["save"] = measure(save_dcp)
            ckpt_dir = where
        dist.barrier()
        if rank == 0:
            rec["files"] = {p.name: p.stat().st_size for p in sorted(ckpt_dir.iterdir()) if p.is_file()}
        for phase in ("load", "resume"):
            fresh_model, fresh_opt = build(case, args.layers, args.dim, fill=False, seed=2)
            if phase == "load":  # the optimizer already has (zero) state: only the checkpoint is timed
                _init_optim_state(fresh_opt)
            if method == "unbroken":
                ckpt = unbroken.Checkpointer(where, preemption=None, keep_last=None)
                ckpt.environment()
                state = {"model": fresh_model, "optimizer": fresh_opt}
                prepare(drop)
                rec[phase] = measure(functools.partial(ckpt.restore, state))
                ckpt.close()
                del state  # it holds the fresh model and optimizer, freed below
            else:
                def load_dcp(fresh_model, fresh_opt) -> None:
                    msd, osd = get_state_dict(fresh_model, fresh_opt)
                    dcp.load({"model": msd, "optim": osd}, checkpoint_id=str(where))
                    set_state_dict(fresh_model, fresh_opt, model_state_dict=msd, optim_state_dict=osd)
                prepare(drop)
                rec[phase] = measure(functools.partial(load_dcp, fresh_model, fresh_opt))
            got = digests(fresh_model, fresh_opt)
            bad = [k for k in expected if got.get(k) != expected[k]] + [k for k in got if k not in expected]
            if bad:
                raise SystemExit(f"rank {rank}: {method} {phase}: {len(bad)} tensors differ, e.g. {bad[:3]}")
            rec["verified_tensors"] = len(got)
            del fresh_model, fresh_opt, got
            gc.collect()
        dist.barrier()
        if rank == 0:
            shutil.rmtree(where)
        return rec

    # warm-up, untimed: imports, DTensor sharding-propagation caches, gloo groups, first-touch
    # of the allocator's memory; otherwise the method that runs first pays for them
    for method in METHODS:
        one(method, root / f"warmup-{method}", drop=False)
    records = []
    for rep in range(args.reps):
        for method in (METHODS if rep % 2 == 0 else METHODS[::-1]):
            rec = {"rep": rep, **one(method, root / f"rep{rep}-{method}", drop=True)}
            records.append(rec)
            if rank == 0:
                print(f"  {case} world {world} rep {rep} {method}: save {rec['save']['s']:.2f} s, "
                      f"load {rec['load']['s']:.2f} s, resume {rec['resume']['s']:.2f} s (rank 0)", flush=True)

    out = {"rank": rank, "world": world, "case": case, "cold_cache": cold, "fingerprint_s": fingerprint_s,
           "init_optim_s": init_optim_s, "local_state_bytes": local_bytes(model, opt),
           "tensors_per_rank": len(expected), "records": records}
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / f"rank{rank}.json").write_text(json.dumps(out))
    dist.barrier()
    dist.destroy_process_group()


# ============================================================================ driver
def machine(root: Path) -> str:
    import torch

    df = subprocess.run(["df", "-hT", str(root)], capture_output=True, text=True).stdout.splitlines()[-1].split()
    mem = next(ln.split()[1] for ln in open("/proc/meminfo") if ln.startswith("MemTotal"))
    return (f"{platform.platform()}, Python {platform.python_version()}, torch {torch.__version__}, "
            f"{os.cpu_count()} CPUs, MemTotal {int(mem) // 1024} MiB, --dir on {df[0]} ({df[1]})")


def median(xs: list[float]) -> float:
    return statistics.median(xs)


def loadavg() -> float:
    return float(Path("/proc/loadavg").read_text().split()[0])


PHASES = ("save", "load", "resume")


def summarise(case: str, world: int, ranks: list[dict]) -> dict:
    """Medians over repetitions of the max over ranks, plus per-rank detail (medians)."""
    reps = max(r["rep"] for r in ranks[0]["records"]) + 1
    out: dict = {"case": case, "world": world, "cold_cache": all(r["cold_cache"] for r in ranks),
                 "fingerprint_s": max(r["fingerprint_s"] for r in ranks),
                 "init_optim_s": max(r["init_optim_s"] for r in ranks),
                 "local_state_bytes": [r["local_state_bytes"] for r in ranks], "methods": {}}
    keys = ("s", "cpu_s", "minflt", "write_bytes", "read_bytes", "wchar", "rchar")
    for m in METHODS:
        per_rep: dict[str, list[float]] = {ph: [] for ph in PHASES}
        rank_rows = {ph: {k: [[] for _ in ranks] for k in keys} for ph in PHASES}
        files = None
        for rep in range(reps):
            recs = [next(x for x in r["records"] if x["rep"] == rep and x["method"] == m) for r in ranks]
            files = recs[0].get("files", files)
            for ph in PHASES:
                per_rep[ph].append(max(x[ph]["s"] for x in recs))
                for i, x in enumerate(recs):
                    for k in keys:
                        rank_rows[ph][k][i].append(x[ph].get(k, 0))  # minflt: absent in older JSON
        assert files is not None
        total = sum(files.values())
        e: dict = {"files": files, "n_files": len(files), "bytes": total,
                   **{f"{ph}_s": median(per_rep[ph]) for ph in PHASES},
                   **{f"{ph}_s_all": per_rep[ph] for ph in PHASES},
                   "per_rank": {ph: {k: [median(v) for v in rank_rows[ph][k]] for k in keys} for ph in PHASES}}
        e["save_MBps_total"] = total / 1e6 / e["save_s"]
        e["load_MBps_total"] = total / 1e6 / e["load_s"]
        # what one rank moved over the collective time (the rate to extrapolate from), and the
        # CPU seconds it spent per GB it moved
        e["save_MBps_per_rank"] = [b / 1e6 / e["save_s"] for b in e["per_rank"]["save"]["write_bytes"]]
        # a load is measured by the state bytes the rank ends up holding: unbroken maps its files,
        # so its reads never pass through read() (rchar) and only the first reader of a page
        # counts it in read_bytes
        held = out["local_state_bytes"]
        e["load_MBps_per_rank"] = [b / 1e6 / e["load_s"] for b in held]
        # (None for a rank that moved under 5 % of the busiest rank's bytes: its own JSON files)
        for ph, moved in (("save", e["per_rank"]["save"]["write_bytes"]), ("load", held)):
            cpu = e["per_rank"][ph]["cpu_s"]
            e[f"{ph}_cpu_s_per_GB"] = [c / (b / 1e9) if b > 0 and b >= 0.05 * max(moved) else None
                                       for c, b in zip(cpu, moved, strict=True)]
        out["methods"][m] = e
    u, d = out["methods"]["unbroken"], out["methods"]["dcp"]
    for ph in PHASES:
        out[f"ratio_{ph}"] = u[f"{ph}_s"] / d[f"{ph}_s"]
    return out


def tables(results: list[dict], md: bool) -> str:
    def render(head: list[str], rows: list[list[str]]) -> str:
        if md:
            lines = ["| " + " | ".join(head) + " |",
                     "|" + "|".join("---" if i < 3 else "---:" for i in range(len(head))) + "|"]
            return "\n".join(lines + ["| " + " | ".join(r) + " |" for r in rows])
        w = [max(len(x) for x in col) for col in zip(head, *rows, strict=True)]
        return "\n".join("  ".join(c.ljust(n) if i < 3 else c.rjust(n)
                                  for i, (c, n) in enumerate(zip(r, w, strict=True)))
                         for r in [head, *rows])

    def span(xs: list[float], scale: float = 1.0, nd: int = 0) -> str:
        if not xs:
            return "-"
        lo, hi = min(xs) / scale, max(xs) / scale
        return f"{lo:.{nd}f}" if f"{lo:.{nd}f}" == f"{hi:.{nd}f}" else f"{lo:.{nd}f}-{hi:.{nd}f}"

    head = ["case", "ranks", "method", "save s", "load s", "resume s", "MB on disk", "files",
            "save MB/s (all ranks)", "load MB/s (all ranks)", "save: unbroken/dcp", "load: unbroken/dcp",
            "resume: unbroken/dcp"]
    rows = []
    for res in results:
        for m in METHODS:
            e = res["methods"][m]
            rows.append([res["case"], str(res["world"]), m, f"{e['save_s']:.2f}", f"{e['load_s']:.2f}",
                         f"{e['resume_s']:.2f}", f"{e['bytes'] / 1e6:.1f}", str(e["n_files"]),
                         f"{e['save_MBps_total']:.0f}", f"{e['load_MBps_total']:.0f}",
                         *[f"{res[f'ratio_{ph}']:.2f}" if m == "unbroken" else "" for ph in PHASES]])
    text = render(head, rows)
    head2 = ["case", "ranks", "method", "save: MB written per rank", "save: MB/s per rank",
             "save: CPU s per GB", "load: MB held per rank", "load: MB through read() per rank",
             "load: MB from disk per rank", "load: MB/s per rank", "load: CPU s per GB", "load: page faults per rank"]
    rows2 = []
    for res in results:
        for m in METHODS:
            e = res["methods"][m]
            pr = e["per_rank"]
            rows2.append([res["case"], str(res["world"]), m, span(pr["save"]["write_bytes"], 1e6),
                          span(e["save_MBps_per_rank"]),
                          span([c for c in e["save_cpu_s_per_GB"] if c is not None], 1, 2),
                          span(res["local_state_bytes"], 1e6), span(pr["load"]["rchar"], 1e6),
                          span(pr["load"]["read_bytes"], 1e6),
                          span(e["load_MBps_per_rank"]),
                          span([c for c in e["load_cpu_s_per_GB"] if c is not None], 1, 2),
                          span(pr["load"]["minflt"])])
    text += "\n\n" + ("Per rank (min-max over the ranks of the medians over repetitions):\n\n" if not md else "") \
        + render(head2, rows2)
    return text


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    p.add_argument("--case", choices=["fsdp", "ddp"], default="fsdp", help=argparse.SUPPRESS)
    p.add_argument("--cases", default="fsdp,ddp", help="fsdp (sharded) and/or ddp (replicated); default both")
    p.add_argument("--worlds", default="2,4", help="world sizes, comma-separated (default 2,4)")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--layers", type=int, default=18)
    p.add_argument("--dim", type=int, default=2048)
    p.add_argument("--dir", default=None, help="where checkpoints are written (default: the temp folder)")
    p.add_argument("--json", default=None, help="write every measurement and the summary here")
    p.add_argument("--markdown", default=None, help="write the tables as markdown here")
    args = p.parse_args()
    if args.worker:
        worker(args)
        return

    worlds = [int(w) for w in args.worlds.split(",")]
    cases = args.cases.split(",")
    if any(args.dim % w for w in worlds):
        p.error("--dim must be divisible by every world size (even shards)")
    base = Path(tempfile.mkdtemp(prefix="bench-dist-", dir=args.dir))
    params = args.layers * (args.dim * args.dim + args.dim)
    print(f"state: {args.layers} x Linear({args.dim}, {args.dim}) = {params * 4 / 1e6:.1f} MB of fp32 "
          f"parameters, ~{3 * params * 4 / 1e6:.0f} MB with AdamW state; cases {cases}, worlds {worlds}, "
          f"{args.reps} reps; writing under {base}", flush=True)
    results, raw = [], []
    try:
        for case in cases:
            for world in worlds:
                tag = f"{case}-w{world}"
                env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
                for attempt in range(2):  # a torchrun start-up can fail on a busy machine: retried once
                    out, ckdir = base / f"results-{tag}-{attempt}", base / f"ckpt-{tag}-{attempt}"
                    ckdir.mkdir()
                    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
                           f"--nproc_per_node={world}", __file__, "--worker", "--case", case, "--out", str(out),
                           "--dir", str(ckdir), "--reps", str(args.reps), "--layers", str(args.layers),
                           "--dim", str(args.dim)]
                    t0, la0 = time.perf_counter(), loadavg()
                    rc = subprocess.run(cmd, env=env).returncode
                    if rc == 0:
                        break
                    print(f"{tag}: torchrun exited with {rc}" + ("; retrying" if attempt == 0 else ""), flush=True)
                    shutil.rmtree(ckdir, ignore_errors=True)
                else:
                    raise SystemExit(f"{tag} failed twice")
                took, la1 = time.perf_counter() - t0, loadavg()
                print(f"{tag}: {took:.0f} s in all, load average {la0:.1f} -> {la1:.1f}", flush=True)
                ranks = [json.loads((out / f"rank{r}.json").read_text()) for r in range(world)]
                raw.append(ranks)
                res = summarise(case, world, ranks)
                res.update(wall_s=took, loadavg=[la0, la1], attempts=attempt + 1)
                results.append(res)
    finally:
        shutil.rmtree(base, ignore_errors=True)

    cold = all(r["cold_cache"] for r in results)
    where = machine(Path(args.dir or tempfile.gettempdir()))
    print()
    print(where)
    print("page cache dropped before every save and load" if cold else "WARM CACHE (could not drop the page cache)")
    print(f"once per process, not in the times: environment fingerprint "
          f"{max(r['fingerprint_s'] for r in results):.2f} s; giving a never-stepped optimizer its state "
          "(_init_optim_state, in 'resume' for dcp and for unbroken fsdp): " +
          ", ".join(f"{r['case']} x{r['world']} {r['init_optim_s']:.2f} s" for r in results))
    print()
    print(tables(results, md=False))
    print()
    for res in results:
        for m in METHODS:
            e = res["methods"][m]
            print(f"all runs, {res['case']} x{res['world']}, {m}: save "
                  + ", ".join(f"{x:.2f}" for x in e["save_s_all"]) + "; load "
                  + ", ".join(f"{x:.2f}" for x in e["load_s_all"]) + "; resume "
                  + ", ".join(f"{x:.2f}" for x in e["resume_s_all"]) + f"; files {sorted(e['files'])}")
    if args.markdown:
        Path(args.markdown).write_text(tables(results, md=True) + "\n")
    if args.json:
        Path(args.json).write_text(json.dumps({
            "config": {"layers": args.layers, "dim": args.dim, "reps": args.reps, "worlds": worlds,
                       "cases": cases, "param_bytes": params * 4},
            "machine": where, "cold_cache": cold, "summary": results, "raw": raw}, indent=1))


if __name__ == "__main__":
    main()
