"""bench_goodput.py's accounting, table and plot: everything computed from the ranks' event records.

Per run (one configuration under one kind of failure), from rank 0's events
(``goodput_worker.py``) and the failure times (the parent's clock for a kill or a node loss, the
worker's ``fault`` record for an exception):

* wall: the job's launch to the end of its last step;
* useful: the sum of the durations (batch fetched to ``optimizer.step()`` done) of the steps that
  count: for each step number, its last execution (an earlier one was undone by a failure);
* goodput = useful / wall: save stalls, startup, restarts, restores and redone steps are the rest;
* per failure: ``restart`` (the failure to the new process's ``ready``: detection, torchrun's
  restart or the relaunch, imports, process group, model), ``restore`` (``ready`` to
  ``restored``) and ``redo`` (``restored`` to the start of the first step not done before the
  failure); ``recovery`` is their sum: the failure to the first new step. ``redone``: the steps
  run again after it.
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path
from typing import Any


def read_events(out: Path, rank: int = 0) -> list[dict[str, Any]]:
    path = out / f"events-r{rank}.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.endswith("}")]


def metrics(events: list[dict[str, Any]], failures: list[float], launched: float, steps: int) -> dict[str, Any]:
    done = [e for e in events if e["ev"] == "step"]
    last: dict[int, dict[str, Any]] = {}
    for e in done:
        last[e["step"]] = e
    finished = sorted(last) == list(range(1, steps + 1))
    useful = sum(e["t"] - e["t0"] for e in last.values())
    wall = max(e["t"] for e in done) - launched if done else float("nan")
    per: list[dict[str, Any]] = []
    failures = sorted(failures)
    for i, tf in enumerate(failures):
        until = failures[i + 1] if i + 1 < len(failures) else float("inf")
        # the failure's recovery: the first `restored` after it (a new process, or recover() in place);
        # every step that ended before that belongs to the attempt the failure ended
        resumed = next((e for e in events if e["ev"] == "restored" and tf < e["t"] < until), None)
        if resumed is None:
            per.append({"t": tf - launched, "recovered": False, "redone": 0})
            continue
        restored = resumed["t"]
        before = max((e["step"] for e in done if e["t"] < restored), default=0)
        after = [e for e in events if restored <= e["t"] < until]
        ready = next((e["t"] for e in events if e["ev"] == "ready" and tf < e["t"] <= restored), tf)
        first_new = next((e for e in after if e["ev"] == "step" and e["step"] > before), None)
        redone = [e["step"] for e in after if e["ev"] == "step" and e["step"] <= before]
        if first_new is None:
            per.append({"t": tf - launched, "step": before, "recovered": False, "redone": len(redone)})
            continue
        per.append({"t": tf - launched, "step": before, "recovered": True, "resumed_from": resumed.get("step"),
                    "restart_s": ready - tf, "restore_s": restored - ready, "redo_s": first_new["t0"] - restored,
                    "recovery_s": first_new["t0"] - tf, "redone": len(redone)})
    ok = [f for f in per if f["recovered"]]
    med = {k: statistics.median(f[k] for f in ok) if ok else None
           for k in ("restart_s", "restore_s", "redo_s", "recovery_s")}
    return {"finished": finished, "wall_s": wall, "useful_s": useful, "goodput": useful / wall if done else 0.0,
            "failures": len(failures), "steps_redone": sum(f["redone"] for f in per),
            "max_redone": max((f["redone"] for f in per), default=0), "per_failure": per,
            "median_step_s": statistics.median(e["t"] - e["t0"] for e in last.values()) if last else None,
            **{f"median_{k}": v for k, v in med.items()}}


def _f(v: Any, fmt: str = "{:.2f}") -> str:
    return "-" if v is None else fmt.format(v)


def ratio(a: Any, b: Any) -> str:
    return "-" if a is None or not b else f"{a / b:.2f}x"


def table(rows: list[dict[str, Any]], md: bool) -> str:
    """One line per configuration x failure kind, with ratios against disk and dcp (same kind)."""
    by = {(r["config"], r["kind"]): r for r in rows}
    head = ["config", "failure", "wall s", "failures", "redone (max/failure)", "recovery s (restart+restore+redo)",
            "recovery vs disk", "recovery vs dcp", "goodput", "goodput vs disk", "goodput vs dcp", "exact"]
    body = []
    for r in rows:
        if r.get("unavailable"):
            body.append([r["config"], r["kind"], "not available: " + r["unavailable"]] + [""] * (len(head) - 3))
            continue
        disk, dcp = by.get(("disk", r["kind"]), {}), by.get(("dcp", r["kind"]), {})
        rec = r.get("median_recovery_s")
        parts = "" if rec is None else (f"{rec:.2f} ({r['median_restart_s']:.2f}+{r['median_restore_s']:.2f}"
                                       f"+{r['median_redo_s']:.2f})")
        exact = {True: "yes", False: "NO", None: "-"}[r.get("exact")]
        body.append([r["config"], r["kind"], _f(r["wall_s"], "{:.1f}"), str(r["failures"]),
                     f"{r['steps_redone']} ({r['max_redone']})" if r["failures"] else "-", parts or "-",
                     ratio(rec, disk.get("median_recovery_s")), ratio(rec, dcp.get("median_recovery_s")),
                     f"{r['goodput']:.3f}", ratio(r["goodput"], disk.get("goodput")),
                     ratio(r["goodput"], dcp.get("goodput")), exact])
    if md:
        lines = ["| " + " | ".join(head) + " |", "|" + "|".join(["---"] * 2 + ["---:"] * (len(head) - 2)) + "|"]
        return "\n".join(lines + ["| " + " | ".join(b) + " |" for b in body])
    w = [max(len(x) for x in col) for col in zip(head, *[b for b in body if b[3] != ""], strict=True)]
    fmt = lambda b: "  ".join(c.ljust(w[i]) if i < 2 else c.rjust(w[i]) for i, c in enumerate(b))  # noqa: E731
    return "\n".join([fmt(head), "  ".join("-" * x for x in w)] +
                     [fmt(b) if b[3] != "" else "  ".join(b[:3]) for b in body])


def chosen_intervals(run_dir: Path) -> dict[str, list[Any]]:
    """The intervals (seconds) ``save_every="auto"`` (``save``) and ``persist_every="auto"`` (``persist``) chose in
    one job, oldest first, from its run index (read before the job's folder is removed); ``{}`` for a run without
    one (``dcp``), ``{"error": [...]}`` when it cannot be read (an older unbroken: ``--base-src``)."""
    try:
        from unbroken.run.index.index import INDEX_FILE, RunIndex

        if not (run_dir / INDEX_FILE).is_file():
            return {}
        with RunIndex(run_dir, readonly=True) as index:
            said = {k: [(e.get("data") or {}).get("seconds") for e in index.events(f"{k}_interval")]
                    for k in ("save", "persist")}
    except Exception as e:  # a report: say it and go on
        return {"error": [f"{type(e).__name__}: {e}"]}
    return {k: [float(x) for x in v if x is not None] for k, v in said.items() if v}


def intervals_table(rows: list[dict[str, Any]], md: bool) -> str:
    """The intervals the ``auto`` configurations chose, per job: first, last, range and count (``""``: none)."""
    head = ["config", "failure", "save interval s: first -> last (min-max, choices)", "persist interval s"]

    def said(xs: list[Any]) -> str:
        if not xs or isinstance(xs[0], str):
            return xs[0] if xs else "-"
        return f"{xs[0]:.3g} -> {xs[-1]:.3g} ({min(xs):.3g}-{max(xs):.3g}, {len(xs)})"

    body = [[r["config"], r["kind"], said(c.get("error") or c.get("save", [])), said(c.get("persist", []))]
            for r in rows if (c := r.get("intervals"))]
    if not body:
        return ""
    if md:
        return "\n".join(["| " + " | ".join(head) + " |", "|" + "|".join(["---"] * len(head)) + "|"] +
                         ["| " + " | ".join(b) + " |" for b in body])
    w = [max(len(x) for x in col) for col in zip(head, *body, strict=True)]
    return "\n".join("  ".join(c.ljust(w[i]) for i, c in enumerate(b)) for b in [head, ["-" * x for x in w], *body])


def plot(rows: list[dict[str, Any]], path: str, title: str) -> None:
    """Goodput and recovery time per configuration, one group of bars per failure kind (matplotlib's
    object API on the Agg canvas, as src/unbroken/run/index/plotting.py draws)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    done = [r for r in rows if not r.get("unavailable")]
    kinds = list(dict.fromkeys(r["kind"] for r in done))
    configs = list(dict.fromkeys(r["config"] for r in done))
    colours = {c: f"C{i % 10}" for i, c in enumerate(configs)}
    fig = Figure(figsize=(11, 4.5), dpi=100, layout="constrained")
    axes = fig.subplots(1, 2)
    width = 0.8 / max(1, len(configs))
    for ax, key, label in ((axes[0], "goodput", "goodput (useful step time / wall time)"),
                           (axes[1], "median_recovery_s", "failure to first new step, s (median)")):
        for j, c in enumerate(configs):
            xs, ys = [], []
            for i, k in enumerate(kinds):
                r = next((r for r in done if r["config"] == c and r["kind"] == k), None)
                if r is not None and r.get(key) is not None and (key == "goodput" or r["failures"]):
                    xs.append(i + (j - (len(configs) - 1) / 2) * width)
                    ys.append(r[key])
            ax.bar(xs, ys, width, label=c, color=colours[c])
        ax.set_xticks(range(len(kinds)), kinds)
        ax.set_xlabel("failure injected")
        ax.set_ylabel(label)
        ax.grid(axis="y", alpha=0.3)
    axes[0].set_ylim(0, 1)
    axes[0].legend(loc="lower left", fontsize=8)
    fig.suptitle(title, fontsize=9)
    FigureCanvasAgg(fig)
    fig.savefig(path)
