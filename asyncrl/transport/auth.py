"""CURVE keys for authenticated, encrypted hub connections (`asyncrl keygen`, `--auth DIR`).

Layout of a key directory, as `asyncrl keygen DIR --clients N` writes it:

    DIR/server.key            the hub's public key (every client needs it)
    DIR/server.key_secret     the hub's secret key (only the hub reads it; mode 0600)
    DIR/clients/client-<i>.key          public keys: the hub's allow-list
    DIR/clients/client-<i>.key_secret   secret keys handed to clients (mode 0600)

The hub runs pyzmq's `ThreadAuthenticator` with every `*.key` file in DIR/clients/ as the
allow-list; a client whose public key is not there is refused during the ZMTP handshake and no
message of it reaches the hub. A client picks `clients/<client_id>.key_secret` when that file
exists, else the first `*.key_secret` in sorted order (several clients may share one key).
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Sequence
from pathlib import Path

import zmq
import zmq.auth
from zmq.auth.thread import ThreadAuthenticator

SERVER_NAME = "server"
CLIENTS_DIR = "clients"


def keygen(directory: str | Path, num_clients: int = 1) -> Path:
    """Write a server keypair and `num_clients` client keypairs into `directory`."""
    if num_clients < 1:
        raise ValueError(f"--clients: must be >= 1, got {num_clients}")
    root = Path(directory)
    clients = root / CLIENTS_DIR
    clients.mkdir(parents=True, exist_ok=True)
    _, secret = zmq.auth.create_certificates(str(root), SERVER_NAME)
    os.chmod(secret, 0o600)
    for i in range(num_clients):
        _, secret = zmq.auth.create_certificates(str(clients), f"client-{i}")
        os.chmod(secret, 0o600)
    return root


def server_keys(auth_dir: str | Path) -> tuple[bytes, bytes]:
    """(public, secret) of the hub."""
    path = Path(auth_dir) / f"{SERVER_NAME}.key_secret"
    if not path.is_file():
        raise ValueError(f"replay.auth_dir: {path} not found (make keys with `asyncrl keygen DIR`)")
    public, secret = zmq.auth.load_certificate(str(path))
    assert secret is not None
    return public, secret


def client_keys(auth_dir: str | Path, client_id: str) -> tuple[bytes, bytes, bytes]:
    """(client public, client secret, server public) for a client."""
    root = Path(auth_dir)
    server_public, _ = zmq.auth.load_certificate(str(root / f"{SERVER_NAME}.key"))
    clients = root / CLIENTS_DIR
    own = clients / f"{client_id}.key_secret"
    candidates = [own] if own.is_file() else sorted(clients.glob("*.key_secret"))
    if not candidates:
        raise ValueError(f"replay.auth_dir: no client secret key in {clients}")
    public, secret = zmq.auth.load_certificate(str(candidates[0]))
    assert secret is not None
    return public, secret, server_public


def start_authenticator(ctx: zmq.Context, auth_dir: str | Path) -> ThreadAuthenticator:
    """Run the allow-list authenticator for every CURVE server socket of `ctx`."""
    clients = Path(auth_dir) / CLIENTS_DIR
    if not clients.is_dir():
        raise ValueError(
            f"replay.auth_dir: {clients} not found (make keys with `asyncrl keygen DIR`)"
        )
    auth = ThreadAuthenticator(ctx)
    auth.start()
    auth.configure_curve(domain="*", location=str(clients))
    return auth


def make_server(sock: zmq.Socket, auth_dir: str | Path) -> None:
    """Turn `sock` into a CURVE server (call before bind)."""
    public, secret = server_keys(auth_dir)
    sock.curve_secretkey = secret
    sock.curve_publickey = public
    sock.curve_server = True


def make_client(sock: zmq.Socket, auth_dir: str | Path, client_id: str) -> None:
    """Turn `sock` into a CURVE client of the hub (call before connect)."""
    public, secret, server_public = client_keys(auth_dir, client_id)
    sock.curve_secretkey = secret
    sock.curve_publickey = public
    sock.curve_serverkey = server_public


def keygen_main(argv: Sequence[str]) -> int:
    """`asyncrl keygen DIR [--clients N]`."""
    p = argparse.ArgumentParser(prog="asyncrl keygen", description="Make CURVE keys for --auth.")
    p.add_argument("dir", help="directory to write the keys into")
    p.add_argument("--clients", type=int, default=1, help="client keypairs to make")
    args = p.parse_args(list(argv))
    root = keygen(args.dir, args.clients)
    print(
        f"wrote {root}/server.key(+_secret) and {args.clients} client keypairs in {root}/{CLIENTS_DIR}/"
    )
    return 0
