"""The cluster manifests (deploy/k8s) and the SLURM script (deploy/slurm) agree with the code.

There is no cluster here, so each file is checked for what would break on one: every manifest
parses; every container command is accepted by the `asyncrl` subcommand's own argument parser
(torchrun's `-m asyncrl ...` and the RayJob entrypoint included); the ConfigMap's run.toml
loads as a config; Services select pods that exist and expose the ports the commands use; the
learner's rendezvous name is its headless Service; volumes name objects that exist or that the
comments say the operator creates; the SLURM script is valid bash whose `asyncrl` lines parse.
"""

from __future__ import annotations

import re
import shlex
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"
EXTERNAL = {"asyncrl-keys", "asyncrl-models"}
"""Objects the operator creates (the keys Secret, the models volume), as the comments say."""


def parse_asyncrl(argv: list[str]) -> Any:
    """Parse `asyncrl SUB ARGS` with SUB's own parser (SystemExit fails the test)."""
    from actors import actor_main
    from launch import ray_cluster as launch
    from learner import main as learner_main
    from replay import main as replay_main

    parsers = {
        "replay": replay_main.parse_args,
        "actor": actor_main.parse_args,
        "learner": learner_main.parse_args,
        "launch": launch.parse_args,
    }
    assert argv[0] in parsers, f"unknown asyncrl subcommand in {argv}"
    return parsers[argv[0]](argv[1:])


def docs() -> list[dict[str, Any]]:
    out = []
    for path in sorted((DEPLOY / "k8s").glob("*.yaml")):
        for doc in yaml.safe_load_all(path.read_text()):
            assert doc and {"apiVersion", "kind", "metadata"} <= set(doc), path
            out.append(doc)
    return out


def pod_templates(doc: dict[str, Any]) -> Iterator[dict[str, Any]]:
    spec = doc.get("spec", {})
    if "template" in spec:
        yield spec["template"]
    cluster = spec.get("rayClusterSpec", {})
    if cluster:
        yield cluster["headGroupSpec"]["template"]
        yield from (g["template"] for g in cluster["workerGroupSpecs"])


def commands() -> list[tuple[str, list[str]]]:
    """(workload name, asyncrl argv) of every container command and RayJob entrypoint."""
    found = []
    for doc in docs():
        for template in pod_templates(doc):
            for c in template["spec"]["containers"]:
                cmd = [str(x) for x in c.get("command", [])]
                if cmd[:1] == ["asyncrl"]:
                    found.append((doc["metadata"]["name"], cmd[1:]))
                elif cmd[:1] == ["torchrun"]:
                    at = cmd.index("-m")
                    assert cmd[at + 1] == "asyncrl", cmd
                    found.append((doc["metadata"]["name"], cmd[at + 2 :]))
        if doc["kind"] == "RayJob":
            entry = shlex.split(doc["spec"]["entrypoint"])
            found.append((doc["metadata"]["name"], entry[1:]))
    return found


def test_every_container_command_parses() -> None:
    found = commands()
    assert {argv[0] for _, argv in found} == {"replay", "actor", "learner", "launch"}
    for _, argv in found:
        parse_asyncrl(argv)


def test_configmap_run_toml_loads(tmp_path: Path) -> None:
    from asyncrl.config import load_config

    config = next(d for d in docs() if d["kind"] == "ConfigMap")
    path = tmp_path / "run.toml"
    path.write_text(config["data"]["run.toml"])
    cfg = load_config(path)
    assert cfg.learner.world == 16 and cfg.weights.backend == "nccl"
    assert cfg.replay.auth_dir == "/keys"


def test_services_ports_and_names_agree() -> None:
    all_docs = docs()
    services = {d["metadata"]["name"]: d for d in all_docs if d["kind"] == "Service"}
    labels = [t.get("metadata", {}).get("labels", {}) for d in all_docs for t in pod_templates(d)]
    for svc in services.values():
        selector = svc["spec"]["selector"]
        assert any(selector.items() <= lab.items() for lab in labels), svc["metadata"]["name"]
    hub_port = services["asyncrl-hub"]["spec"]["ports"][0]["port"]
    for _, argv in commands():
        args = parse_asyncrl(argv)
        if argv[0] == "replay":
            assert args.bind.rsplit(":", 1)[1] == str(hub_port)
        if argv[0] in ("actor", "learner"):
            host, port = re.fullmatch(r"tcp://([\w.-]+):(\d+)", args.hub).groups()
            assert (host, int(port)) == ("asyncrl-hub", hub_port)


def test_learner_rendezvous_is_its_headless_service() -> None:
    all_docs = docs()
    job = next(d for d in all_docs if d["kind"] == "Job")
    svc = next(
        d
        for d in all_docs
        if d["kind"] == "Service"
        and d["metadata"]["name"] == job["spec"]["template"]["spec"]["subdomain"]
    )
    assert svc["spec"]["clusterIP"] == "None"
    cmd = job["spec"]["template"]["spec"]["containers"][0]["command"]
    master = cmd[cmd.index("--master-addr") + 1]
    assert master == f"{job['metadata']['name']}-0.{svc['metadata']['name']}"
    nnodes = int(cmd[cmd.index("--nnodes") + 1])
    assert nnodes == job["spec"]["completions"] == job["spec"]["parallelism"]
    assert job["spec"]["completionMode"] == "Indexed"


def test_volumes_name_existing_objects() -> None:
    all_docs = docs()
    have = {d["metadata"]["name"] for d in all_docs} | EXTERNAL
    for d in all_docs:
        for template in pod_templates(d):
            for vol in template["spec"].get("volumes", []):
                for kind, key in (
                    ("configMap", "name"),
                    ("secret", "secretName"),
                    ("persistentVolumeClaim", "claimName"),
                ):
                    if kind in vol:
                        assert vol[kind][key] in have, (d["metadata"]["name"], vol)


def test_slurm_script_is_bash_and_its_asyncrl_lines_parse() -> None:
    script = DEPLOY / "slurm" / "asyncrl.sbatch"
    subprocess.run(["bash", "-n", str(script)], check=True)
    text = script.read_text().replace("\\\n", " ")
    lines = [ln.split(">")[0] for ln in text.splitlines() if re.search(r"(^|\s)asyncrl \w", ln)]
    lines = [ln for ln in lines if not ln.lstrip().startswith("#")]
    assert len(lines) == 3, lines
    for line in lines:
        words = shlex.split(line)
        at = words.index("asyncrl")
        argv = [w if "$" not in w else "X" for w in words[at + 1 :]]
        parse_asyncrl(argv)


@pytest.mark.parametrize("path", sorted((DEPLOY / "k8s").glob("*.yaml")), ids=lambda p: p.name)
def test_manifest_names_carry_the_app_label(path: Path) -> None:
    for doc in yaml.safe_load_all(path.read_text()):
        assert doc["metadata"]["labels"]["app.kubernetes.io/name"] == "asyncrl"


def test_prometheus_annotations_match_the_metrics_ports(tmp_path: Path) -> None:
    """Each role's pods are annotated for scraping on the port its process serves /metrics on
    (the ConfigMap's [metrics]), and the container declares that port."""
    from asyncrl.config import load_config

    all_docs = docs()
    config = next(d for d in all_docs if d["kind"] == "ConfigMap")
    path = tmp_path / "run.toml"
    path.write_text(config["data"]["run.toml"])
    metrics = load_config(path).metrics
    ports = {"hub": metrics.hub_port, "actor": metrics.actor_port, "learner": metrics.learner_port}
    annotated = set()
    for d in all_docs:
        for template in pod_templates(d):
            meta = template.get("metadata", {})
            role = meta.get("labels", {}).get("app.kubernetes.io/component")
            if role not in ports:
                continue
            notes = meta["annotations"]
            assert (
                notes["prometheus.io/scrape"] == "true"
                and notes["prometheus.io/path"] == "/metrics"
            )
            assert int(notes["prometheus.io/port"]) == ports[role] > 0, role
            declared = [
                p["containerPort"] for c in template["spec"]["containers"] for p in c["ports"]
            ]
            assert ports[role] in declared, role
            annotated.add(role)
    assert annotated == set(ports)
