"""tests/dist_train.py, plus a record of how each rank ended (``OUT/exit-r<rank>``: the exit status
it leaves with), for the torchrun signal tests: torchrun reaps its workers without reporting it."""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
import dist_train

if __name__ == "__main__":
    signal.signal(signal.SIGINT, signal.default_int_handler)
    out = Path(sys.argv[sys.argv.index("--out") + 1])
    code: object = 1
    try:
        code = dist_train.main()
    except SystemExit as e:
        code = e.code
    finally:
        out.mkdir(parents=True, exist_ok=True)
        (out / f"exit-r{os.environ.get('RANK', '0')}").write_text(str(code))
    sys.exit(code)
