"""The `asyncrl` command: one subcommand per process role, each loaded lazily.

    asyncrl replay  --config C [--bind EP] [--dataset F]   the hub (replay/main.py)
    asyncrl actor   --config C --hub EP [--engine E]       a rollout actor (actors/actor_main.py)
    asyncrl learner --config C --hub EP [--world N]       the learner (learner/main.py)
    asyncrl run     CONFIG [--run-dir D] [--set k=v ...]   everything on this machine (launch/run.py)
    asyncrl keygen  DIR [--clients N]                      CURVE keys for --auth (asyncrl/transport/auth.py)
    asyncrl bench   NAME [args...]                         a benchmark from bench/
    asyncrl launch  CONFIG --ray [ADDRESS]                 everything on a Ray cluster (launch/ray_cluster.py)
    asyncrl status  ENDPOINT [--watch] [--pause|--resume]  a live hub's summary (tools/status.py)
    asyncrl inspect RUN_DIR [--reward-max X ...] [--show N] kept trajectories (tools/inspect.py)
    asyncrl report  RUN_DIR                                RUN_DIR/report.html (tools/report.py)
    asyncrl eval    CHECKPOINT [--task T] [--samples N]    evaluate a checkpoint (tools/eval.py)
    asyncrl sandbox run FILE [--stdin F] [--timeout S]     one sandboxed run, JSON out (actors/sandbox)
    asyncrl score   --task T --row R.json --completion F   score one completion (tools/score.py)
    asyncrl reward-server --model DIR [--bind EP] [--auth DIR]
                                                           a served reward model (actors/rewards/rm_server.py)

Subcommand modules are imported only when chosen, so `asyncrl replay` never imports torch.
"""

from __future__ import annotations

import sys

from asyncrl.plugins import load_attr

COMMANDS = {
    "replay": ("replay.main", "main"),
    "actor": ("actors.actor_main", "main"),
    "learner": ("learner.main", "main"),
    "run": ("launch.run", "main"),
    "keygen": ("asyncrl.transport.auth", "keygen_main"),
    "bench": ("launch.bench_cli", "main"),
    "eval": ("tools.eval", "main"),
    "inspect": ("tools.inspect", "main"),
    "report": ("tools.report", "main"),
    "status": ("tools.status", "main"),
    "launch": ("launch.ray_cluster", "main"),
    "sandbox": ("actors.sandbox.cli", "main"),
    "score": ("tools.score", "main"),
    "reward-server": ("actors.rewards.rm_server", "main"),
}


def main(argv: list[str] | None = None) -> int:
    """Dispatch `asyncrl SUBCOMMAND ...` to its module's main(argv)."""
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in ("-h", "--help"):
        print(__doc__)
        return 0 if args else 2
    name, rest = args[0], args[1:]
    if name not in COMMANDS:
        print(
            f"asyncrl: unknown command {name!r} (choose from {', '.join(COMMANDS)})",
            file=sys.stderr,
        )
        return 2
    module, func = COMMANDS[name]
    return int(load_attr(f"{module}:{func}", what=f"asyncrl {name}")(rest) or 0)


if __name__ == "__main__":
    sys.exit(main())
