"""A store prefix that every rank of *this* round agrees on and no earlier round used.

torchrun keeps one store for all the restart rounds of a job (the agent's, shared by its
workers), and torch never clears it: a process group created under the same keys as in the
previous round can read a dead peer's address and fail ("Gloo connectFullMesh failed ...
Connection refused") or wait until its timeout. Keys scoped to a fresh prefix avoid that.

The restart count (``TORCHELASTIC_RESTART_COUNT``) is not a safe prefix: it is counted per
node, and a node whose workers were restarted because another node failed does not count
that restart, so two nodes can disagree on it. :func:`fresh_prefix` agrees through the
store itself, without any round number:

1. rank 0 draws a random token and sets ``<key>/leader`` to it;
2. every other rank draws a random nonce, reads ``<key>/leader`` and answers under it
   (``<key>/<token>/<rank>`` = nonce), then waits for ``<key>/go/<nonce>``;
3. rank 0 waits for the answers under *its* token (only this round's ranks can know it)
   and sets ``<key>/go/<nonce>`` = token for each.

A rank that read an earlier round's leader answered under a dead token and gets no ``go``:
it reads the leader again every second until it sees this round's token. Only this round's
rank 0 writes ``go/<nonce>`` (the nonce is fresh), so no rank can leave with an old token.
"""

from __future__ import annotations

import time
import uuid
from datetime import timedelta
from typing import Any, Callable

POLL_S = 1.0


def fresh_prefix(store: Any, rank: int, world: int, key: str, timeout_s: float,
                 error: Callable[[str], Exception]) -> str:
    """A prefix (``unbroken/<token>``) every rank of this round gets, unused by any earlier round.

    A collective over ``store`` (all ``world`` ranks call it with the same ``key``). A rank
    that does not take part within ``timeout_s`` makes the others raise ``error(message)``."""
    base = f"unbroken/agree/{key}"
    deadline = time.monotonic() + timeout_s
    if rank == 0:
        token = uuid.uuid4().hex
        store.set(f"{base}/leader", token)
        for peer in range(1, world):
            answer = f"{base}/{token}/{peer}"
            try:
                store.wait([answer], timedelta(seconds=max(deadline - time.monotonic(), 0.001)))
            except RuntimeError as e:  # DistStoreError (a timeout) is a RuntimeError
                raise error(f"rank {peer} did not join within {timeout_s:.0f} s ({e})") from None
            store.set(f"{base}/go/{bytes(store.get(answer)).decode()}", token)
        return f"unbroken/{token}"
    nonce, answered = uuid.uuid4().hex, None
    while True:
        try:
            if store.check([f"{base}/leader"]):
                leader = bytes(store.get(f"{base}/leader")).decode()
                if leader != answered:
                    store.set(f"{base}/{leader}/{rank}", nonce)
                    answered = leader
            store.wait([f"{base}/go/{nonce}"], timedelta(seconds=POLL_S))
            return f"unbroken/{bytes(store.get(f'{base}/go/{nonce}')).decode()}"
        except RuntimeError as e:  # not yet (DistStoreError is a RuntimeError): the leader may be stale
            if time.monotonic() > deadline:
                raise error(f"rank 0 did not answer within {timeout_s:.0f} s ({e})") from None
            time.sleep(0.1)
