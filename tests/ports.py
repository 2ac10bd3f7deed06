"""Free TCP ports for the servers and process groups the tests start, below the kernel's ephemeral range.

A port taken with ``bind(0)`` and released is an *ephemeral* port: the kernel hands it out again for any
other ``bind(0)`` or outgoing connection (another worker's client, a server's peer) before the server the
test starts binds it, and that server fails with EADDRINUSE (it did: the S3 test server, a requeued SLURM
job's process group). Below the range only an explicit choice takes a port: the servers of other workers,
a collision that is rare (chosen at random) and that a caller retries where it can."""

from __future__ import annotations

import random
import socket
from pathlib import Path


def free_ports(n: int) -> list[int]:
    """``n`` distinct ports, free now, below the ephemeral range."""
    try:
        low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        low = 32768
    rng, out = random.SystemRandom(), []
    while len(out) < n:
        port = rng.randrange(10000, max(low, 10000 + 4 * n))
        if port in out:
            continue
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        out.append(port)
    return out


def free_port() -> int:
    """One port, free now, below the ephemeral range."""
    return free_ports(1)[0]
