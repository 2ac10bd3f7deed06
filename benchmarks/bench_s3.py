"""Upload and download throughput of unbroken checkpoints to a local S3 server, against plain s3fs.

One fresh SeaweedFS S3 server (``tests/s3_server.py``, ``weed mini`` on 127.0.0.1) is
started for the whole run and stopped at the end, also on errors. The state is the
GPT-2-small-like training state of ``bench_save_load.py`` (fp32 parameters plus an
AdamW-like ``exp_avg``/``exp_avg_sq``/``step`` per parameter, deterministic), scaled
to ``--size-mb`` MB (10^6 bytes) of tensor data: 1024 MB = 400 tensors by default.

Methods, each timed in a fresh subprocess from "nothing set up yet" (imports done, no
S3 client created) to done, so that every method pays for its client start-up alike:

UPLOAD

* ``unbroken``: ``unbroken.save("s3://bucket/run/ckpt", state, storage_options=...)``:
  xxh3-128 of every byte, parallel multipart uploads (64 MiB parts, 8 I/O threads),
  then the manifest PUT that commits it.
* ``s3fs put``: ``fs.put(local_file, key)`` of the same tensors written (untimed, just
  before, so the page cache is warm) as one safetensors file; s3fs's default multipart
  upload (50 MiB parts, ``max_concurrency=10``).
* ``s3fs pipe``: ``fs.pipe(key, data)`` of the same safetensors file held in memory
  (``safetensors.torch.save``, untimed): the in-memory equivalent of ``put``.

DOWNLOAD

* ``unbroken``: ``unbroken.load(url, storage_options=...)``: ranged parallel GETs into
  one buffer, xxh3-128 checked, tensors parsed (views into the buffer).
* ``s3fs get``: ``fs.get(key, local_file)`` of the object ``s3fs put`` wrote (no fsync).
* ``s3fs cat``: ``fs.cat(key)`` of that object into memory (``bytes``).

The s3fs baselines neither checksum nor parse anything. Every download is checked after
the clock stops (tensor by tensor for unbroken, byte for byte for s3fs, against xxh3
digests taken by the uploading process). The runs go round robin over the methods,
``--repeats`` times; medians are reported. Before each measurement ``sync`` is called
(dirty pages of the previous one must not be flushed during the next), and each
repetition's objects are deleted after it (SeaweedFS keeps their disk space until it
stops: the temp folder needs ~3 x ``--size-mb`` x ``--repeats`` free, ~10 GB by
default). Besides wall time, each child reports its own CPU time, the server's CPU time
(``/proc/<weed>/stat``) and its peak extra RSS, all over the timed part only.

    python benchmarks/bench_s3.py [--size-mb 1024] [--repeats 3] [--json FILE] [--markdown FILE]
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parent / "tests")]

UPLOADS = {"unbroken": "unbroken.save", "s3fs_put": "s3fs put (file)", "s3fs_pipe": "s3fs pipe (bytes)"}
DOWNLOADS = {"unbroken": "unbroken.load (+verify)", "s3fs_get": "s3fs get (file)", "s3fs_cat": "s3fs cat (bytes)"}


# ----------------------------------------------------------------------------- child side
def proc_kib(key: str) -> int:
    return int(re.search(rf"^{key}:\s+(\d+) kB", Path("/proc/self/status").read_text(), re.MULTILINE).group(1))


def server_cpu(pid: int) -> float:
    """CPU seconds (user + system) used so far by the server process and its waited-for children."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return sum(int(x) for x in fields[11:15]) / os.sysconf("SC_CLK_TCK")


class Timed:
    """Wall time, this process's CPU time, the server's CPU time and the peak extra RSS of a block."""

    def __init__(self, server_pid: int) -> None:
        self.pid = server_pid

    def __enter__(self) -> Timed:
        gc.collect()
        try:
            Path("/proc/self/clear_refs").write_text("5\n")  # reset VmHWM
        except OSError:
            pass
        self.rss0, self.srv0, self.cpu0 = proc_kib("VmRSS"), server_cpu(self.pid), time.process_time()
        self.t0 = time.perf_counter()
        return self

    def __exit__(self, *exc: object) -> None:
        self.wall = time.perf_counter() - self.t0
        self.cpu = time.process_time() - self.cpu0
        self.srv = server_cpu(self.pid) - self.srv0
        self.rss = (proc_kib("VmHWM") - self.rss0) * 1024

    def result(self) -> dict:
        return {"s": self.wall, "client_cpu_s": self.cpu, "server_cpu_s": self.srv, "peak_rss": self.rss}


def run_child(args: argparse.Namespace) -> dict:
    import s3fs
    import safetensors.torch
    import torch
    import xxhash

    import unbroken
    from bench_save_load import build_state, flatten

    phase, method = args.child.split(":")
    opts = json.loads(os.environ["BENCH_S3_OPTIONS"])
    work, digests = Path(args.work), Path(args.work) / "digests.json"
    prefix = f"{args.bucket}/r{args.rep}"
    url, key = f"s3://{prefix}/ckpt", f"{prefix}-s3fs/state.safetensors"
    timer = Timed(args.server_pid)
    if phase == "up":
        state = build_state(args.size_mb / 3)  # parameters + exp_avg + exp_avg_sq: ~3x
        flat = flatten(state)
        res = {"nbytes": sum(t.numel() * t.element_size() for t in flat.values()), "ntensors": len(flat)}
        if method == "unbroken":
            with timer:
                unbroken.save(url, state, storage_options=opts)
            digests.write_text(json.dumps({k: xxhash.xxh3_128_hexdigest(t.reshape(-1).view(torch.uint8).numpy())
                                           for k, t in flat.items()}))
            res["object_bytes"] = sum(s3fs.S3FileSystem(**opts).du(f"{prefix}/ckpt", total=False).values())
        elif method == "s3fs_put":
            local = work / "put.safetensors"
            safetensors.torch.save_file(flat, str(local))
            with timer:
                fs = s3fs.S3FileSystem(**opts)
                fs.put(str(local), key)
            with open(local, "rb") as f:
                (work / "s3fs.digest").write_text(xxhash.xxh3_128_hexdigest(f.read()))
            local.unlink()
            res["object_bytes"] = fs.size(key)
        else:  # s3fs_pipe
            data = safetensors.torch.save(flat)
            with timer:
                fs = s3fs.S3FileSystem(**opts)
                fs.pipe(key + ".pipe", data)
            res["object_bytes"] = fs.size(key + ".pipe")
        return {**res, **timer.result()}
    # down
    if method == "unbroken":
        with timer:
            loaded = unbroken.load(url, storage_options=opts)
        want = json.loads(digests.read_text())
        got = flatten(loaded)
        assert got.keys() == want.keys(), "unbroken.load: the keys differ"
        bad = [k for k, t in got.items() if xxhash.xxh3_128_hexdigest(t.reshape(-1).view(torch.uint8).numpy())
               != want[k]]
        assert not bad, f"unbroken.load: {len(bad)} tensors differ, e.g. {bad[0]}"
        return timer.result()
    want = (work / "s3fs.digest").read_text()
    if method == "s3fs_get":
        local = work / "get.safetensors"
        with timer:
            fs = s3fs.S3FileSystem(**opts)
            fs.get(key, str(local))
        with open(local, "rb") as f:
            got = xxhash.xxh3_128_hexdigest(f.read())
        local.unlink()
    else:  # s3fs_cat
        with timer:
            fs = s3fs.S3FileSystem(**opts)
            data = fs.cat(key)
        got = xxhash.xxh3_128_hexdigest(data)
    assert got == want, f"{method}: the downloaded bytes differ from the uploaded ones"
    return timer.result()


# ---------------------------------------------------------------------------- parent side
def machine() -> str:
    import aiobotocore
    import botocore
    import s3fs
    import torch

    from s3_server import weed_binary

    cpu = next((ln.split(":", 1)[1].strip() for ln in Path("/proc/cpuinfo").read_text().splitlines()
                if ln.startswith("model name")), platform.processor())
    mem = int(re.search(r"MemTotal:\s+(\d+)", Path("/proc/meminfo").read_text()).group(1)) * 1024 / 1e9
    weed = subprocess.run([weed_binary(), "version"], capture_output=True, text=True).stdout.strip().splitlines()
    return (f"{os.cpu_count()} cores ({cpu}), {mem:.0f} GB RAM; Linux {platform.release()}, Python "
            f"{platform.python_version()}, torch {torch.__version__}, s3fs {s3fs.__version__}, aiobotocore "
            f"{aiobotocore.__version__}, botocore {botocore.__version__}; SeaweedFS {weed[0] if weed else '?'} "
            "(weed mini) on 127.0.0.1 of the same machine")


def summarize(results: dict, nbytes: int) -> dict:
    """Medians, MB/s and ratios, flat (the --json output)."""
    mb = nbytes / 1e6
    out: dict = {"state_bytes": nbytes}
    for phase, methods in (("upload", UPLOADS), ("download", DOWNLOADS)):
        for m in methods:
            runs = results[phase][m]
            s = statistics.median(r["s"] for r in runs)
            out[f"{phase}_{m}_s"] = s
            out[f"{phase}_{m}_MBps"] = mb / s
            for k in ("client_cpu_s", "server_cpu_s"):
                out[f"{phase}_{m}_{k}"] = statistics.median(r[k] for r in runs)
            out[f"{phase}_{m}_peak_rss_MB"] = max(r["peak_rss"] for r in runs) / 1e6
            out[f"{phase}_{m}_runs_s"] = [round(r["s"], 3) for r in runs]
        for m in methods:
            if m != "unbroken":  # > 1: unbroken takes longer than this baseline
                out[f"{phase}_ratio_unbroken_vs_{m}"] = out[f"{phase}_unbroken_s"] / out[f"{phase}_{m}_s"]
    return out


def table(s: dict) -> tuple[list[str], list[list[str]]]:
    head = ["direction", "method", "median s", "MB/s", "unbroken time / this", "client CPU s", "server CPU s",
            "peak extra RSS MB"]
    rows = []
    for phase, methods in (("upload", UPLOADS), ("download", DOWNLOADS)):
        for m, label in methods.items():
            p = f"{phase}_{m}"
            ratio = "1.00" if m == "unbroken" else f"{s[f'{phase}_ratio_unbroken_vs_{m}']:.2f}"
            rows.append([phase, label, f"{s[p + '_s']:.2f}", f"{s[p + '_MBps']:.0f}", ratio,
                         f"{s[p + '_client_cpu_s']:.2f}", f"{s[p + '_server_cpu_s']:.2f}",
                         f"{s[p + '_peak_rss_MB']:.0f}"])
    return head, rows


def render(head: list[str], rows: list[list[str]], md: bool) -> str:
    if md:
        lines = ["| " + " | ".join(head) + " |", "|" + "|".join(["---"] * 2 + ["---:"] * (len(head) - 2)) + "|"]
        return "\n".join(lines + ["| " + " | ".join(r) + " |" for r in rows])
    w = [max(len(x) for x in col) for col in zip(head, *rows, strict=True)]

    def fmt(r: list[str]) -> str:
        return "  ".join(c.ljust(w[i]) if i < 2 else c.rjust(w[i]) for i, c in enumerate(r))

    return "\n".join([fmt(head), "  ".join("-" * x for x in w)] + [fmt(r) for r in rows])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size-mb", type=float, default=1024.0,
                    help="MB (10^6 bytes) of tensors (default 1024; the smallest GPT-2 layout is ~97 MB)")
    ap.add_argument("--repeats", type=int, default=3, help="runs per method; medians are reported (default 3)")
    ap.add_argument("--json", metavar="FILE", help="write the medians, MB/s and ratios as JSON")
    ap.add_argument("--markdown", metavar="FILE", help="also write the report as markdown")
    for name in ("--child", "--work", "--bucket"):
        ap.add_argument(name, help=argparse.SUPPRESS)
    ap.add_argument("--rep", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--server-pid", type=int, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:  # one measurement in its own process; the result is the last line of stdout
        print(json.dumps(run_child(args)))
        return

    from s3_server import S3Server

    # SIGTERM (a plain `kill`) unwinds like an error, so that the finally below stops the server
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    server = S3Server()
    work = Path(tempfile.mkdtemp(prefix="unbroken-bench-s3-"))
    results: dict = {"upload": {m: [] for m in UPLOADS}, "download": {m: [] for m in DOWNLOADS}}
    loadavg, meta = [], {}
    try:
        server.start()
        bucket = server.new_bucket()
        fs = server.fs()
        env = {**os.environ, "BENCH_S3_OPTIONS": json.dumps(server.storage_options)}
        for rep in range(args.repeats):  # round robin: a slow spell of a noisy machine hits every method
            for phase, methods in (("up", UPLOADS), ("down", DOWNLOADS)):
                for m in methods:
                    print(f"[run {rep + 1}/{args.repeats}] {phase}load {m}", file=sys.stderr, flush=True)
                    os.sync()
                    loadavg.append(float(Path("/proc/loadavg").read_text().split()[0]))
                    cmd = [sys.executable, __file__, "--child", f"{phase}:{m}", "--size-mb", str(args.size_mb),
                           "--work", str(work), "--bucket", bucket, "--rep", str(rep),
                           "--server-pid", str(server.proc.pid)]
                    p = subprocess.run(cmd, env=env, check=False, capture_output=True, text=True)
                    if p.returncode:
                        raise RuntimeError(f"{phase}load {m} failed:\n{p.stderr}\nserver log:\n{server.log_tail()}")
                    r = json.loads(p.stdout.strip().splitlines()[-1])
                    results[f"{phase}load"][m].append(r)
                    if phase == "up":
                        meta.update(nbytes=r["nbytes"], ntensors=r["ntensors"])
                        meta[f"object_bytes_{m}"] = r["object_bytes"]
                    print(f"    {r['s']:.2f} s", file=sys.stderr, flush=True)
            fs.invalidate_cache()
            for prefix in (f"{bucket}/r{rep}", f"{bucket}/r{rep}-s3fs"):  # (SeaweedFS frees the space only later)
                fs.rm(prefix, recursive=True)
        info = machine()
    finally:
        server.cleanup()
        shutil.rmtree(work, ignore_errors=True)

    summary = summarize(results, meta["nbytes"])
    summary.update(ntensors=meta["ntensors"], repeats=args.repeats, size_mb=args.size_mb,
                   loadavg_min=min(loadavg), loadavg_max=max(loadavg), machine=info,
                   **{k: v for k, v in meta.items() if k.startswith("object_bytes")})
    title = (f"State: {meta['nbytes'] / 1e6:.0f} MB in {meta['ntensors']} fp32 tensors (--size-mb {args.size_mb:g}); "
             f"objects: unbroken {meta['object_bytes_unbroken'] / 1e6:.0f} MB, safetensors "
             f"{meta['object_bytes_s3fs_put'] / 1e6:.0f} MB. Median of {args.repeats} runs; 1-min load average "
             f"{min(loadavg):.1f}-{max(loadavg):.1f} before the runs. MB/s = state MB / median s. "
             "\"unbroken time / this\" > 1: unbroken took longer than that baseline.")
    runs = "\n".join(f"- {phase} {m}: {[round(r['s'], 2) for r in rs]}"
                     for phase in ("upload", "download") for m, rs in results[phase].items())
    head, rows = table(summary)
    print(f"{title}\nMachine: {info}\n\n{render(head, rows, md=False)}\n\nAll runs (s):\n{runs}")
    if args.markdown:
        Path(args.markdown).write_text(f"{title}\n\nMachine: {info}\n\n{render(head, rows, md=True)}\n\n"
                                       f"All runs (s):\n\n{runs}\n")
    if args.json:
        Path(args.json).write_text(json.dumps(summary, indent=2) + "\n")


if __name__ == "__main__":
    main()
