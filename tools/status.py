"""`asyncrl status ENDPOINT`: a running hub's live summary as a table.

    asyncrl status tcp://127.0.0.1:5555          once (ENDPOINT may also be a run directory:
    asyncrl status runs/tiny_cpu --watch 2        its hub.endpoint is read), or every 2 s
    asyncrl status runs/tiny_cpu --pause "look"   stop granting credits (actors idle), --resume

```
  asyncrl status ──StatusRequest / Control──> hub (replay/observer.py) ──Status──> format_status
```

The query needs no Hello and no matching config: any peer the hub's socket admits may ask
(loopback, or with `--auth DIR` a CURVE key of that directory). Exit code 1 when the hub does
not answer within `--timeout` seconds.
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import zmq

from asyncrl.protocol.codec import decode, encode
from asyncrl.protocol.messages import Control, Error, Message, Status, StatusRequest
from asyncrl.transport.sockets import connect_dealer, recv_parts, send_parts
from tools.inspect import format_table

CLEAR = "\x1b[2J\x1b[H"


def query(endpoint: str, msg: Message, timeout_s: float, auth_dir: str = "") -> dict[str, Any]:
    """Send one StatusRequest or Control to the hub; return the status it answers with."""
    ctx = zmq.Context()
    client_id = f"status-{os.getpid()}-{secrets.token_hex(3)}"
    sock = connect_dealer(
        ctx,
        endpoint,
        client_id,
        hwm=100,
        max_message_bytes=64 << 20,
        heartbeat_s=1.0,
        auth_dir=auth_dir,
    )
    try:
        send_parts(sock, encode(msg))
        if not sock.poll(int(timeout_s * 1000)):
            raise TimeoutError(f"no answer from the hub at {endpoint} within {timeout_s:g} s")
        reply = decode(recv_parts(sock))
    finally:
        sock.close(linger=0)
        ctx.term()
    if isinstance(reply, Error):
        raise ValueError(f"the hub refused: {reply.code} {reply.field}: {reply.detail}")
    if not isinstance(reply, Status):
        raise ValueError(f"the hub answered {type(reply).__name__}, not Status")
    return reply.status


def _fmt(value: Any, digits: int = 3) -> str:
    return f"{value:.{digits}g}" if isinstance(value, float) else str(value)


def client_lines(clients: dict[str, dict[str, Any]]) -> str:
    header = [
        ("client", 10),
        ("role", 7),
        ("alive", 5),
        ("weights", 7),
        ("lag", 3),
        ("credits", 7),
        ("silent s", 8),
        ("note", 4),
    ]
    lines = []
    for cid, c in sorted(clients.items(), key=lambda kv: (kv[1].get("role", ""), kv[0])):
        actor = c.get("role") == "actor"
        lines.append(
            [
                cid,
                str(c.get("role", "?")),
                "yes" if c.get("alive") else "no",
                str(c.get("loaded_version", "-")) if actor else "-",
                str(c.get("lag", "-")) if actor else "-",
                str(c.get("outstanding", "-")) if actor else "-",
                _fmt(c.get("silent_s", "-")),
                str(c.get("why", "")),
            ]
        )
    return format_table(header, lines)


def format_status(s: dict[str, Any]) -> str:
    """The summary as the lines `asyncrl status` prints."""
    t, st, buf, ev = s["throughput"], s["staleness"], s["buffer"], s["eval"]
    paused = f"   PAUSED ({s['paused']})" if s["paused"] else ""
    hist = " ".join(f"{k}:{v}" for k, v in st["hist"].items()) or "none yet"
    out = [
        f"hub {s['endpoint']}   up {s['uptime_s']:.0f} s   policy version {s['policy_version']}{paused}",
        f"throughput (last {t['window_s']:.0f} s): {t['groups_received_per_s']:.2f} groups/s in, "
        f"{t['groups_consumed_per_s']:.2f} consumed = {t['samples_per_s']:.1f} samples/s; "
        f"{t['versions_per_s']:.2f} versions/s",
        f"staleness of consumed groups: mean {st['mean']:.2f}, max {st['max']} "
        f"(bound η = {st['bound']}); histogram {hist}",
        f"buffer: {buf['stored']} groups stored of {buf['capacity']}; "
        f"{buf['parked_requests']} learner request(s) waiting",
        "",
        client_lines(s["clients"]),
        "",
    ]
    errors = ", ".join(f"{k} {v}" for k, v in sorted(s["errors"].items())) or "none"
    out.append(f"errors refused: {errors}")
    alarms = s["alarms"]
    out.append(f"alarms: {s['num_alarms']}" + (" (latest last):" if alarms else ""))
    out += [
        f"  step {a['step']} (version {a['policy_version']}) {a['name']} [{a['action']}]: "
        f"{a['message']}"
        for a in alarms[-5:]
    ]
    if ev["every_versions"]:
        last = ev["last"]
        tail = (
            (
                f"; last: version {last['policy_version']}, reward {last['reward_mean']:.3f}, "
                f"pass@1 {last['pass@1']:.3f}, length {last['length_mean']:.1f}"
            )
            if last
            else ""
        )
        out.append(
            f"eval: every {ev['every_versions']} versions; {ev['requested']} asked, "
            f"{ev['results']} done{tail}"
        )
    c = s["counters"]
    out.append(
        f"groups: {c['groups_received']} received, {c['groups_stored']} stored, "
        f"{c['groups_consumed']} consumed, {c['groups_dropped_stale']} dropped as stale, "
        f"{c['groups_duplicate']} duplicates; credits: {c['credits_issued']} issued, "
        f"{c['credits_outstanding']} outstanding, {c['credits_expired']} expired; "
        f"prompts re-issued {c['prompts_reissued']}"
    )
    return "\n".join(out)


def resolve_endpoint(target: str) -> str:
    """An endpoint, or a run directory's hub.endpoint."""
    path = Path(target)
    if path.is_dir():
        file = path / "hub.endpoint"
        if not file.is_file():
            raise ValueError(f"{path}: no hub.endpoint (is the run's hub up?)")
        return file.read_text().strip()
    return target


def main(argv: Sequence[str]) -> int:
    p = argparse.ArgumentParser(prog="asyncrl status", description="A live hub's summary.")
    p.add_argument("endpoint", help="hub endpoint (tcp://host:port, ipc://path) or run directory")
    p.add_argument(
        "--watch",
        type=float,
        nargs="?",
        const=2.0,
        default=0.0,
        metavar="SECONDS",
        help="refresh every SECONDS (default 2) until Ctrl-C",
    )
    p.add_argument(
        "--pause",
        nargs="?",
        const="operator",
        default=None,
        metavar="REASON",
        help="stop granting credits (the actors idle)",
    )
    p.add_argument("--resume", action="store_true", help="grant credits again")
    p.add_argument("--json", action="store_true", help="print the raw summary as JSON")
    p.add_argument("--auth", default="", metavar="DIR", help="CURVE key dir of the hub")
    p.add_argument("--timeout", type=float, default=5.0, help="seconds to wait for an answer")
    args = p.parse_args(list(argv))
    endpoint = resolve_endpoint(args.endpoint)
    msg: Message = StatusRequest()
    if args.pause is not None or args.resume:
        msg = (
            Control(action="resume", reason="")
            if args.resume
            else Control(action="pause", reason=args.pause)
        )
    try:
        while True:
            status = query(endpoint, msg, args.timeout, args.auth)
            text = json.dumps(status, indent=1) if args.json else format_status(status)
            print((CLEAR if args.watch else "") + text, flush=True)
            if not args.watch:
                return 0
            msg = StatusRequest()
            time.sleep(args.watch)
    except TimeoutError as exc:
        print(f"asyncrl status: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 0
