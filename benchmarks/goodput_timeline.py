"""Where a restart's time goes: bench_goodput.py's per-failure timeline after a rank SIGKILL.

From clocks on one machine (``time.time()`` everywhere):

* the kill (the parent's clock, just before ``os.kill``);
* torchrun's agent noticing (its ``Sending process ... closing signal SIGTERM`` line to the
  surviving rank, time-stamped when the parent read it from the agent's output;
  ``--monitor-interval`` sets how often the agent looks), then, once the survivor has exited,
  its ``Worker group FAILED``, ``Rendezvous'ing`` and ``Starting worker group`` lines;
* the surviving rank's process ending (polled every 5 ms by the parent: gone, or a zombie);
* the new rank-0 process: when the kernel started it (``spawned``, 10 ms resolution), its first
  line (``launch``: the interpreter is up), then ``import torch``, ``import unbroken`` (with the
  benchmark's model module), the process group, the model (built and wrapped in DDP), ``ready``
  (the Checkpointer constructed, or the DCP loop's objects) and ``restored``.

Each segment is the time from the previous mark to the next; the segments add up to the
failure-to-``restored`` time (restart + restore in goodput_report.py's terms). A mark that is
missing (an old log format, a line not seen) is skipped: its time goes to the next segment.
"""

from __future__ import annotations

import statistics
from pathlib import Path
from typing import Any

AGENT = (("noticed", "closing signal"), ("failed", "Worker group FAILED"),
         ("rendezvous", "Rendezvous'ing worker group"), ("starting", "Starting worker group"))
SEGMENTS = (("agent: notices, stops the survivor", "failed"), ("agent: rendezvous, start", "starting"),
            ("process spawn (fork/exec)", "spawned"), ("interpreter start", "launch"), ("import torch", "import torch"),
            ("import unbroken + model module", "import unbroken"), ("process group", "process group"),
            ("model + DDP", "model"), ("Checkpointer / loop setup", "ready"), ("restore", "restored"))


def agent_lines(log: Path) -> list[tuple[float, str]]:
    """The time-stamped lines of the job's log (``<time> <line>``, as bench_goodput.py writes them)."""
    out = []
    for line in log.read_text(errors="replace").splitlines():
        head, _, rest = line.partition(" ")
        try:
            out.append((float(head), rest))
        except ValueError:
            continue
    return out


def marks(kill: float, until: float, events: list[dict[str, Any]], lines: list[tuple[float, str]],
          survivor_gone: float | None) -> dict[str, float]:
    """The marks of one failure at ``kill`` (those before ``until``, the next failure)."""
    m: dict[str, float] = {"kill": kill}
    for name, text in AGENT:
        t = next((t for t, line in lines if kill <= t < until and text in line), None)
        if t is not None:
            m[name] = t
    if survivor_gone is not None:
        m["survivor_gone"] = survivor_gone
    launch = next((e for e in events if e["ev"] == "launch" and kill < e["t"] < until), None)
    if launch is None:
        return m
    if launch.get("spawned") is not None:
        m["spawned"] = max(launch["spawned"], m.get("starting", kill))
    m["launch"] = launch["t"]
    for e in events:
        if e["t"] < launch["t"] or e["t"] >= until or e.get("pid") != launch.get("pid"):
            continue
        if e["ev"] == "phase":
            m.setdefault(e["what"], e["t"])
        elif e["ev"] in ("ready", "restored"):
            m.setdefault(e["ev"], e["t"])
    return m


INFO = (("(kill to the agent's SIGTERM to the survivor)", "noticed"),
        ("(kill to the survivor's exit)", "survivor_gone"))


def segments(m: dict[str, float]) -> dict[str, float]:
    """Seconds per segment of one failure's marks (a missing mark's time goes to the next one); they
    add up to the kill-to-``restored`` time. Also, not segments (they overlap the first): when the
    agent signalled the survivor and when the survivor ended, from the kill."""
    out: dict[str, float] = {}
    prev = m["kill"]
    for label, key in SEGMENTS:
        if key in m:
            out[label] = m[key] - prev
            prev = m[key]
    return out


def info(m: dict[str, float]) -> dict[str, float]:
    return {label: m[key] - m["kill"] for label, key in INFO if key in m}


def breakdown(kills: list[float], survivors: list[float | None], events: list[dict[str, Any]],
              log: Path) -> list[dict[str, float]]:
    """One ``{segment: seconds}`` per kill (rank 0's events; the job's time-stamped log)."""
    lines = agent_lines(log) if log.exists() else []
    out = []
    for i, k in enumerate(kills):
        until = kills[i + 1] if i + 1 < len(kills) else float("inf")
        m = marks(k, until, events, lines, survivors[i])
        out.append({"segments": segments(m), "info": info(m)})
    return out


def median_table(rows: list[dict[str, Any]], md: bool = True) -> str:
    """Median seconds per segment, one column per configuration that has kill timelines."""
    cols = [r for r in rows if r.get("timeline")]
    if not cols:
        return ""
    head = ["segment"] + [f"{r['config']} (n={len(r['timeline'])})" for r in cols]
    body = []
    for label in [s for s, _ in SEGMENTS] + ["total (kill to restored)"] + [s for s, _ in INFO]:
        cells = []
        for r in cols:
            vals = [t["segments"].get(label, sum(t["segments"].values()) if label.startswith("total") else None)
                    if not label.startswith("(") else t["info"].get(label) for t in r["timeline"]]
            vals = [v for v in vals if v is not None]
            cells.append(f"{statistics.median(vals):.2f}" if vals else "-")
        body.append([label, *cells])
    if md:
        lines = ["| " + " | ".join(head) + " |", "|---|" + "---:|" * len(cols)]
        return "\n".join(lines + ["| " + " | ".join(b) + " |" for b in body])
    w = [max(len(x) for x in col) for col in zip(head, *body, strict=True)]
    return "\n".join("  ".join(c.ljust(w[0]) if i == 0 else c.rjust(w[i]) for i, c in enumerate(b))
                     for b in [head, *body])
