"""Launching above the roles: `asyncrl run` (run.py) with its supervision (supervise.py) and
child processes (processes.py), the Ray launcher (ray_cluster.py) and `asyncrl bench` (bench_cli.py).
This package may import every role; no role imports it."""
