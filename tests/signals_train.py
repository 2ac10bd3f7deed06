"""tests/dist_train.py, plus a record of how each rank ended (``OUT/exit-r<rank>``: the exit status
it leaves with), for the torchrun signal tests: torchrun reaps its workers without reporting it.
``LINGER_RANK=R`` makes rank R wait, before that record, until rank 0 has exited, then ``LINGER_S``
seconds more (a slow teardown: the agent's SIGTERM to it when rank 0 exits arrives while it exits;
a rank it kills leaves no record)."""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
import dist_train

if __name__ == "__main__":
    signal.signal(signal.SIGINT, signal.default_int_handler)
    linger = float(os.environ.get("LINGER_S", "0")) if os.environ.get("LINGER_RANK") == os.environ.get("RANK", "0") \
        else 0.0
    out = Path(sys.argv[sys.argv.index("--out") + 1])
    code: object = 1
    try:
        code = dist_train.main()
    except SystemExit as e:
        code = e.code
    finally:
        if linger:  # a slow teardown, still going when rank 0 has exited (and the agent SIGTERMs this rank):
            import time  # a signal that ends the process here leaves no record

            other = int((out / "pid-r0").read_text())
            deadline = time.monotonic() + 60
            while os.path.exists(f"/proc/{other}") and time.monotonic() < deadline:
                time.sleep(0.05)
            time.sleep(linger)
        out.mkdir(parents=True, exist_ok=True)
        (out / f"exit-r{os.environ.get('RANK', '0')}").write_text(str(code))
    sys.exit(code)
