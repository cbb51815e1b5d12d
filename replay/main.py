"""`asyncrl replay`: the hub process. Parses its arguments, loads the config, starts the `Hub`
of replay/server.py (and its metrics endpoint), writes the bound endpoint where asked, and
serves until SIGTERM."""

from __future__ import annotations

import argparse
import gc
import json
import logging
import signal
import sys
from collections.abc import Sequence
from pathlib import Path

from asyncrl.config import load_config
from asyncrl.files import replace_text
from asyncrl.metrics import start as start_metrics
from asyncrl.transport.sockets import keep_freed_buffers
from replay.server import Hub

HUB_COUNTERS = (
    "groups_received",
    "groups_stored",
    "groups_consumed",
    "groups_dropped_stale",
    "groups_duplicate",
    "groups_adopted",
    "groups_trained",
    "groups_returned",
    "weights_announced",
    "sends_dropped",
    "credits_issued",
    "credits_expired",
    "credits_returned",
    "prompts_reissued",
)
"""Hub statistics that only grow (exported as Prometheus counters)."""


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    """The command line of `asyncrl replay`."""
    p = argparse.ArgumentParser(prog="asyncrl replay", description="Run the replay hub.")
    p.add_argument("--config", default=None, help="run config TOML (defaults when absent)")
    p.add_argument(
        "--set", action="append", default=[], metavar="KEY=VALUE", help="config override"
    )
    p.add_argument(
        "--bind", default=None, help="endpoint (overrides replay.bind), e.g. tcp://127.0.0.1:0"
    )
    p.add_argument("--dataset", default=None, help="JSONL prompts (overrides task.dataset)")
    p.add_argument("--endpoint-file", default=None, help="write the bound endpoint here")
    p.add_argument(
        "--auth", default=None, metavar="DIR", help="CURVE key dir (overrides replay.auth_dir)"
    )
    p.add_argument(
        "--allow-insecure", action="store_true", help="allow a non-loopback bind without auth"
    )
    p.add_argument("--log-level", default="INFO")
    return p.parse_args(list(argv))


def main(argv: Sequence[str]) -> int:
    """`asyncrl replay --config C [--set k=v] [--bind EP] [--dataset F] [--endpoint-file F]`."""
    args = parse_args(argv)
    logging.basicConfig(
        level=args.log_level, format="%(asctime)s %(name)s %(levelname)s %(message)s"
    )
    overrides = list(args.set) + ([f"replay.auth_dir={json.dumps(args.auth)}"] if args.auth else [])
    cfg = load_config(args.config, overrides)
    dataset = args.dataset or cfg.task.dataset
    if not dataset:
        raise ValueError("asyncrl replay: give --dataset FILE or set task.dataset")
    keep_freed_buffers()  # before ZeroMQ's I/O thread starts allocating
    hub = Hub(cfg, dataset, bind=args.bind, allow_insecure=args.allow_insecure)
    if cfg.metrics.hub_port:
        hub.obs.live = start_metrics("hub", "hub", cfg.metrics.hub_port, HUB_COUNTERS)
    if args.endpoint_file:
        replace_text(Path(args.endpoint_file), hub.endpoint + "\n")  # never half-written
    print(f"asyncrl replay: serving on {hub.endpoint}", flush=True)
    # The buffer holds many long-lived objects and each message makes short-lived ones that
    # form no cycles: default GC thresholds would rescan the buffer many times a second.
    gc.freeze()
    gc.set_threshold(100_000, 50, 100)
    signal.signal(signal.SIGTERM, lambda *_: hub.stop())
    signal.signal(signal.SIGINT, lambda *_: hub.stop())
    hub.serve_forever()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
