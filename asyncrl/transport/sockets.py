"""Sockets: the hub's ROUTER (`bind_router`), the clients' DEALER (`connect_dealer`), the
multipart send/receive both sides use, and where listening ports are picked when none is given
(`listen_port_range`, `free_port`: below the kernel's ephemeral range). The client connection
itself, `HubConnection`, is asyncrl/transport/connection.py.

Only this module and asyncrl/transport/connection.py create ZeroMQ sockets. Both sides set explicit
high-water marks, `MAXMSGSIZE`, `LINGER` and ZMTP heartbeats; with `auth_dir` both sides use
CURVE (asyncrl/transport/auth.py). Without auth the hub refuses to bind anything but loopback or ipc.

Zero-copy: frames are received with `copy=False` (a `zmq.Frame` owns the bytes ZeroMQ read,
and decoded arrays are views of it) and sent with `copy=False`: a received frame sent again
goes out as the same ZeroMQ message (no copy), and an array buffer of at least the socket's
`copy_threshold` (64 KiB by default) is handed to ZeroMQ without a copy. Smaller buffers are
copied once, which is cheaper than tracking them.
"""

from __future__ import annotations

import ctypes
import ipaddress
import random
import socket
from pathlib import Path
from typing import Any

import zmq

from asyncrl.config import ReplayConfig
from asyncrl.transport import auth

LINGER_MS = 1000


# plain ints: pyzmq's flag enums cost an enum construction per `|` on the per-message path
NOBLOCK, SNDMORE = int(zmq.NOBLOCK), int(zmq.SNDMORE)
# the compiled send and recv themselves, called with positional arguments (keywords cost a
# parse per frame): zmq.Socket.send only adds DRAFT routing_id/group handling on top
_send, _recv = zmq.backend.Socket.send, zmq.backend.Socket.recv


def send_parts(sock: zmq.Socket, parts: list[Any], flags: int = 0) -> None:
    """`send_multipart(parts, copy=False)` without its per-call overhead (large parts zero-copy).

    Raises zmq.Again (NOBLOCK, pipe full) only on the first part: ZeroMQ queues the rest of a
    multipart message once its first part is accepted.
    """
    more = flags | SNDMORE
    for part in parts[:-1]:
        _send(sock, part, more, False)  # copy=False
    _send(sock, parts[-1], flags, False)


def recv_parts(sock: zmq.Socket, flags: int = 0) -> list[zmq.Frame]:
    """`recv_multipart(copy=False)` reading `Frame.more` instead of a getsockopt per part."""
    frame = _recv(sock, flags, False)  # copy=False: a zmq.Frame
    parts = [frame]
    while frame.more:
        frame = _recv(sock, 0, False)  # the rest of a multipart message is already here
        parts.append(frame)
    return parts


def recv_routed(sock: zmq.Socket, flags: int = 0) -> tuple[bytes, list[zmq.Frame]]:
    """A ROUTER's next message: (the sender's routing id, its frames). The routing id comes as
    bytes (a copy of a few bytes is cheaper than a Frame); ZeroMQ always follows it with the
    message itself. Raises zmq.Again (NOBLOCK) only when no message is waiting."""
    identity = sock.recv(flags)
    return identity, recv_parts(sock)


def keep_freed_buffers(trim_bytes: int = 256 << 20, mmap_bytes: int = 32 << 20) -> bool:
    """Let malloc (glibc) reuse freed message buffers instead of returning them to the system.

    ZeroMQ mallocs each received message. By default glibc serves large ones with fresh mmap'ed
    pages or trims the heap once a few MB are free, so a process that receives, holds and
    releases many large messages (the hub) spends much of its CPU faulting in and zeroing new
    pages: half of the hub's CPU for 2 MB groups. With allocations below `mmap_bytes` served
    from the heap and up to `trim_bytes` of freed memory kept, buffers are recycled. Call it
    once, early, in a process that moves large messages; False where libc has no mallopt.
    """
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return False
    m_trim_threshold, m_mmap_threshold = -1, -3  # from glibc's malloc.h
    ok = mallopt(m_mmap_threshold, mmap_bytes) == 1
    return mallopt(m_trim_threshold, trim_bytes) == 1 and ok


def is_local_endpoint(endpoint: str) -> bool:
    """True for ipc://, inproc:// and tcp:// on a loopback address."""
    scheme, _, rest = endpoint.partition("://")
    if scheme in ("ipc", "inproc"):
        return True
    if scheme != "tcp" or ":" not in rest:
        raise ValueError(f"replay.bind: {endpoint!r} is not tcp://host:port or ipc://path")
    host = rest.rsplit(":", 1)[0].strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:  # '*', an interface name or a hostname
        return False


def set_socket_options(
    sock: zmq.Socket, hwm: int, max_message_bytes: int, heartbeat_s: float
) -> None:
    sock.setsockopt(zmq.SNDHWM, hwm)
    sock.setsockopt(zmq.RCVHWM, hwm)
    sock.setsockopt(zmq.MAXMSGSIZE, max_message_bytes)
    sock.setsockopt(zmq.LINGER, LINGER_MS)
    ivl_ms = max(1, int(heartbeat_s * 1000))
    sock.setsockopt(zmq.HEARTBEAT_IVL, ivl_ms)
    sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, 10 * ivl_ms)
    sock.setsockopt(zmq.HEARTBEAT_TTL, 10 * ivl_ms)


RESERVED_BELOW = 20000  # ports below are others' by default (Ray's workers: 10002-19999)


def listen_port_range() -> tuple[int, int]:
    """[low, high) to pick a listening port from when none is given: below the kernel's
    ephemeral range (/proc/sys/net/ipv4/ip_local_port_range), which bind(0) and outgoing
    connections draw from. So no client connection takes a port picked here in the meantime,
    and a client reconnecting to a restarted server on it cannot connect to itself (a TCP
    self-connect on loopback holds the port and the restarted server cannot bind it). And from
    `RESERVED_BELOW` up: Ray's workers take ports 10002-19999 by default (asyncrl under Ray, or
    beside it), and a port of theirs picked here makes one of the two fail to start."""
    try:
        first = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        first = 32768  # Linux's default; other systems start theirs higher
    if first > RESERVED_BELOW + 1000:
        return RESERVED_BELOW, first
    return 49152, 65536  # an unusually wide ephemeral range: the IANA dynamic ports


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on `host` now, from `listen_port_range()`, for a process that binds it
    later (torch.distributed's MASTER_PORT); the kernel's choice if none of 200 tries is free."""
    low, high = listen_port_range()
    for port in random.sample(range(low, high), min(200, high - low)):
        with socket.socket() as s:
            try:
                s.bind((host, port))
            except OSError:
                continue
            return port
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def bind_router(
    ctx: zmq.Context, endpoint: str, cfg: ReplayConfig, *, allow_insecure: bool = False
) -> tuple[zmq.Socket, str]:
    """Bind the hub's ROUTER; returns it and the actual endpoint (port 0: a free port from
    `listen_port_range()`).

    With `cfg.auth_dir` the socket is a CURVE server; start `auth.start_authenticator` on `ctx`
    first so the allow-list applies.
    """
    if not cfg.auth_dir and not allow_insecure and not is_local_endpoint(endpoint):
        raise ValueError(
            f"replay.bind / --bind: {endpoint!r} is not a loopback address; set replay.auth_dir "
            "(--auth DIR, keys from `asyncrl keygen`) or pass --allow-insecure"
        )
    sock = ctx.socket(zmq.ROUTER)
    set_socket_options(sock, cfg.hwm, cfg.max_message_bytes, cfg.heartbeat_interval_s)
    sock.setsockopt(zmq.ROUTER_HANDOVER, 1)
    sock.setsockopt(zmq.ROUTER_MANDATORY, 1)  # a full or vanished peer raises, never drops
    if cfg.auth_dir:
        auth.make_server(sock, cfg.auth_dir)
    try:
        if endpoint.startswith("tcp://") and endpoint.endswith(":0"):
            address = endpoint[: -len(":0")]
            low, high = listen_port_range()
            port = sock.bind_to_random_port(address, min_port=low, max_port=high)
            endpoint = f"{address}:{port}"
        else:
            sock.bind(endpoint)
            if endpoint.startswith("tcp://"):
                endpoint = sock.getsockopt_string(zmq.LAST_ENDPOINT)
    except zmq.ZMQError as exc:
        sock.close(linger=0)
        raise ValueError(f"replay.bind / --bind: cannot bind {endpoint!r}: {exc}") from exc
    return sock, endpoint


RECONNECT_IVL_MS, RECONNECT_IVL_MAX_MS = 100, 5000


def connect_dealer(
    ctx: zmq.Context,
    endpoint: str,
    client_id: str,
    *,
    hwm: int,
    max_message_bytes: int,
    heartbeat_s: float,
    auth_dir: str = "",
) -> zmq.Socket:
    """A client's DEALER, connected to the hub at `endpoint` with routing id `client_id`."""
    dealer = ctx.socket(zmq.DEALER)
    set_socket_options(dealer, hwm, max_message_bytes, heartbeat_s)
    dealer.setsockopt(zmq.ROUTING_ID, client_id.encode())
    # a lost hub is redialled with exponential backoff: 0.1 s, doubling up to 5 s
    dealer.setsockopt(zmq.RECONNECT_IVL, RECONNECT_IVL_MS)
    dealer.setsockopt(zmq.RECONNECT_IVL_MAX, RECONNECT_IVL_MAX_MS)
    if auth_dir:
        auth.make_client(dealer, auth_dir, client_id)
    dealer.connect(endpoint)
    return dealer
