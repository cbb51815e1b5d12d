"""Listening ports picked by asyncrl (the hub's and reward server's `:0`, MASTER_PORT) come from
below the kernel's ephemeral range, where no outgoing connection can take them."""

import socket
from pathlib import Path

import zmq

from asyncrl.config import ReplayConfig
from asyncrl.transport.sockets import bind_router, free_port, listen_port_range


def test_the_range_ends_where_the_kernel_starts_handing_out_ports() -> None:
    low, high = listen_port_range()
    proc = Path("/proc/sys/net/ipv4/ip_local_port_range")
    if proc.is_file():
        first = int(proc.read_text().split()[0])
        assert (low, high) == ((20000, first) if first > 21000 else (49152, 65536))
    assert 1024 < low < high <= 65536
    assert low >= 20000, "Ray's workers take 10002-19999 by default: ports there are theirs"


def test_free_port_is_in_the_range_and_bindable() -> None:
    low, high = listen_port_range()
    ports = {free_port() for _ in range(5)}
    for port in ports:
        assert low <= port < high
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))  # still free: nothing else was handed it


def test_the_hub_binds_port_zero_in_the_range() -> None:
    low, high = listen_port_range()
    with zmq.Context() as ctx:
        sock, endpoint = bind_router(ctx, "tcp://127.0.0.1:0", ReplayConfig())
        try:
            assert endpoint.startswith("tcp://127.0.0.1:")
            assert low <= int(endpoint.rsplit(":", 1)[1]) < high
        finally:
            sock.close(linger=0)
