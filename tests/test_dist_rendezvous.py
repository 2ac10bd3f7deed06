"""The fresh store prefix the ranks of one round agree on (unbroken.dist.rendezvous), on a real
TCPStore that still holds an earlier round's keys, as torchrun's agent store does."""

from __future__ import annotations

import threading
from datetime import timedelta

import pytest
import torch.distributed as dist

from unbroken.dist.comm import CoordinationError
from unbroken.dist.rendezvous import fresh_prefix
from ports import free_port


def server() -> dist.TCPStore:
    return dist.TCPStore("127.0.0.1", free_port(), is_master=True, wait_for_workers=False,
                         timeout=timedelta(seconds=30))


def client(master: dist.TCPStore) -> dist.PrefixStore:
    store = dist.TCPStore("127.0.0.1", master.port, is_master=False, timeout=timedelta(seconds=30))
    return dist.PrefixStore("default_pg", store)


def agree(master: dist.TCPStore, ranks: list[int], results: dict) -> None:
    def call(rank: int) -> None:
        try:
            results[rank] = fresh_prefix(client(master), rank, 2, "group0", 30, CoordinationError)
        except Exception as e:
            results[rank] = e

    threads = {r: threading.Thread(target=call, args=(r,)) for r in ranks}
    for t in threads.values():
        t.start()
    for t in threads.values():
        t.join(timeout=60)


def test_a_rank_that_reads_the_previous_rounds_leader_still_gets_this_rounds_prefix() -> None:
    master = server()
    before: dict = {}
    agree(master, [0, 1], before)  # the previous round: its keys stay in the store
    assert before[0] == before[1] and before[0].startswith("unbroken/")
    old_token = before[0].split("/")[1]
    stale_answer = f"default_pg/unbroken/agree/group0/{old_token}/1"
    old_nonce = master.get(stale_answer)

    now: dict = {}
    late = threading.Thread(target=agree, args=(master, [1], now))
    late.start()  # rank 1 of the new round comes first: only the previous round's leader is there
    while master.get(stale_answer) == old_nonce:  # until it answered that stale leader
        master.wait([stale_answer], timedelta(seconds=30))
    agree(master, [0], now)  # then rank 0 of the new round
    late.join(timeout=60)
    assert now[0] == now[1], now  # the same prefix on both ranks...
    assert now[0] != before[0]  # ...and not the one of the previous round


def test_an_absent_rank_0_is_an_error_that_says_so_not_a_hang() -> None:
    master = server()
    with pytest.raises(CoordinationError, match="rank 0 did not answer within 2 s"):
        fresh_prefix(client(master), 1, 2, "group0", 2, CoordinationError)
    with pytest.raises(CoordinationError, match="rank 1 did not join within 2 s"):
        fresh_prefix(client(master), 0, 2, "group0", 2, CoordinationError)


@pytest.mark.parametrize("earlier_round", [False, True], ids=["first-round", "after-a-round"])
def test_a_rank_that_came_before_rank_0_is_woken_by_it_not_by_its_poll(monkeypatch, earlier_round: bool) -> None:
    """A rank that arrives before rank 0 (no leader yet, or only an earlier round's) is woken as
    soon as rank 0 comes, through its hello: with the poll made an hour long, the old protocol
    (answer the leader found, then wait a poll) left it waiting for the whole hour."""
    import unbroken.dist.rendezvous as rendezvous

    master = server()
    if earlier_round:
        agree(master, [0, 1], {})
    monkeypatch.setattr(rendezvous, "POLL_S", 3600.0)
    now: dict = {}
    first = threading.Thread(target=agree, args=(master, [1], now))
    first.start()
    hello = "default_pg/unbroken/agree/group0/hello/1"
    master.wait([hello], timedelta(seconds=30))  # rank 1 is there and waiting (with a stale leader if any)
    agree(master, [0], now)
    first.join(timeout=60)
    assert not first.is_alive(), "rank 1 was not woken by rank 0's arrival"
    assert now.get(0) == now.get(1) and now[0].startswith("unbroken/"), now
