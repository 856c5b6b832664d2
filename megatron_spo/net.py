"""Local networking helpers shared by process groups, engines and tests.

A port probed free (``free_port``) may be taken by any other socket before the process meant for it binds it (the
CI's quickstart lost its rendezvous port so). Where this process binds the port itself, bind port 0 and hand the
bound port on (``hosted_store``, ``listening_socket``); ``free_port`` is for ports another program binds later
(an SGLang engine, the router), whose launcher must then handle "address already in use" (rollout/fleet.py)."""

from __future__ import annotations

import socket
from datetime import timedelta

# Set by a launcher that hosts the c10d store at MASTER_ADDR:MASTER_PORT itself (models/parallel.start_local):
# every rank, rank 0 included, joins it as a client instead of rank 0 binding the port.
STORE_HOSTED_ENV = "MEGATRON_SPO_STORE_HOSTED"


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on ``host`` right now (the OS picks it; another process may take it before use)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def listening_socket(host: str = "127.0.0.1") -> socket.socket:
    """A TCP socket bound to a port the OS picks and already listening (``getsockname()[1]``): no window in
    which another process can take the port."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.bind((host, 0))
        sock.listen(128)
    except BaseException:
        sock.close()
        raise
    return sock


def hosted_store(world_size: int, timeout: timedelta, host: str = "127.0.0.1"):
    """A c10d TCPStore server listening on a port the OS picked as it bound (``.port``); the ranks of a group of
    ``world_size`` join it as clients. It serves as long as this object lives."""
    from torch.distributed import TCPStore

    return TCPStore(host, 0, world_size, is_master=True, timeout=timeout, wait_for_workers=False)
