"""A store prefix that every rank of *this* round agrees on and no earlier round used.

torchrun keeps one store for all the restart rounds of a job (the agent's, shared by its
workers), and torch never clears it: a process group created under the same keys as in the
previous round can read a dead peer's address and fail ("Gloo connectFullMesh failed ...
Connection refused") or wait until its timeout. Keys scoped to a fresh prefix avoid that.

The restart count (``TORCHELASTIC_RESTART_COUNT``) is not a safe prefix: it is counted per
node, and a node whose workers were restarted because another node failed does not count
that restart, so two nodes can disagree on it. :func:`fresh_prefix` agrees through the
store itself, without any round number:

1. every other rank draws a random nonce and says hello (``<key>/hello/<rank>`` = nonce),
   then reads ``<key>/leader`` if there is one and answers under it
   (``<key>/<token>/<rank>`` = nonce), then waits for ``<key>/go/<nonce>``;
2. rank 0 draws a random token, sets ``<key>/leader`` to it, then sets ``<key>/go/<nonce>``
   = token for every hello it finds (a rank that arrived first and read an earlier round's
   leader is woken at once), waits for the answers under *its* token (only this round's
   ranks can know it) and sets ``<key>/go/<nonce>`` = token for each;
3. a rank woken by ``go`` answers under the token it got, if it has not yet, and leaves.

The store orders the operations, so a rank that read an earlier round's leader said hello
before rank 0 set this round's, and rank 0 reads that hello after: it is woken without
waiting for its poll. A hello of an earlier round only gets a ``go`` nobody waits for. A
rank that nothing woke (not expected) reads the leader again every :data:`POLL_S` seconds.
Only this round's rank 0 writes ``go/<nonce>`` (the nonce is fresh), so no rank can leave
with an old token.

Before the hello, a rank that arrived before rank 0 waited a whole poll (1 s, then 0.1 s)
after rank 0 came, twice per restart (``init_distributed`` and the Checkpointer's group):
up to 2.2 s of every torchrun restart.
"""

from __future__ import annotations

import time
import uuid
from datetime import timedelta
from typing import Any, Callable

POLL_S = 1.0
"""Seconds between a waiting rank's reads of the leader (a fallback: rank 0 wakes it through its hello)."""


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
        for peer in range(1, world):  # ranks that came first, maybe answering an earlier leader: wake them
            hello = f"{base}/hello/{peer}"
            if store.check([hello]):
                store.set(f"{base}/go/{bytes(store.get(hello)).decode()}", token)
        for peer in range(1, world):
            answer = f"{base}/{token}/{peer}"
            try:
                store.wait([answer], timedelta(seconds=max(deadline - time.monotonic(), 0.001)))
            except RuntimeError as e:  # DistStoreError (a timeout) is a RuntimeError
                raise error(f"rank {peer} did not join within {timeout_s:.0f} s ({e})") from None
            store.set(f"{base}/go/{bytes(store.get(answer)).decode()}", token)
        return f"unbroken/{token}"
    nonce, answered = uuid.uuid4().hex, None
    store.set(f"{base}/hello/{rank}", nonce)
    while True:
        try:
            if store.check([f"{base}/leader"]):
                leader = bytes(store.get(f"{base}/leader")).decode()
                if leader != answered:
                    store.set(f"{base}/{leader}/{rank}", nonce)
                    answered = leader
            store.wait([f"{base}/go/{nonce}"], timedelta(seconds=POLL_S))
            token = bytes(store.get(f"{base}/go/{nonce}")).decode()
            if token != answered:  # woken by its hello: rank 0 waits for the answer under its token
                store.set(f"{base}/{token}/{rank}", nonce)
            return f"unbroken/{token}"
        except RuntimeError as e:  # not yet (DistStoreError is a RuntimeError): the leader may be stale
            if time.monotonic() > deadline:
                raise error(f"rank 0 did not answer within {timeout_s:.0f} s ({e})") from None
            time.sleep(0.1)
