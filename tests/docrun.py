"""Runs code blocks of the docs as a process would (for tests/test_doc_blocks.py).

``python tests/docrun.py SPEC RESULTS``: SPEC is a JSON list of ``{"id", "code", "cwd"}``; each block runs in
a fresh namespace with ``cwd`` as the working folder, one after the other in this process (the imports are
paid once), and every Checkpointer the block left in its namespace is closed after it. RESULTS gets one
``{"id", "ok", "error"}`` per block; a block that raises does not stop the next ones.
"""

from __future__ import annotations

import gc
import json
import os
import sys
import traceback


def main(spec_path: str, results_path: str) -> int:
    spec = json.loads(open(spec_path).read())
    results = []
    for block in spec:
        os.makedirs(block["cwd"], exist_ok=True)
        os.chdir(block["cwd"])
        namespace: dict = {"__name__": "__docblock__"}
        try:
            exec(compile(block["code"], block["id"], "exec"), namespace)
            results.append({"id": block["id"], "ok": True, "error": None})
        except BaseException:
            results.append({"id": block["id"], "ok": False, "error": traceback.format_exc()[-4000:]})
        finally:
            _close(namespace)
            namespace.clear()
            gc.collect()
        with open(results_path, "w") as f:
            json.dump(results, f)
    return 0


def _close(namespace: dict) -> None:
    """Close what the block opened and left open (a script ending would: here the next block follows)."""
    import unbroken

    for value in list(namespace.values()):
        close = getattr(value, "close", None)
        if isinstance(value, unbroken.Checkpointer) or type(value).__module__.startswith("unbroken.integrations"):
            if callable(close):
                try:
                    close()
                except Exception:
                    pass


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], sys.argv[2]))
