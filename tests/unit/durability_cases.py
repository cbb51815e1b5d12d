"""Helpers of the write-ahead-log tests (test_durability.py, test_snapshots.py): a small hub
state, groups small and big, a workload of every op, and ways to look at the state files."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import numpy as np

from asyncrl.config import load_config
from asyncrl.prompt_records import Prompt
from asyncrl.protocol.codec import encode
from asyncrl.protocol.messages import Group, Trajectory
from replay.core import HubState
from replay.durability import WriteAheadLog, read_records
from replay.prompts import PromptSource
from replay.wal_records import END_MARKER, TornRecord

CFG = load_config(None, ["learner.groups_per_step=2", "replay.max_staleness=1"])


def fresh(incarnation: int = 1) -> HubState:
    prompts = PromptSource([Prompt(f"p{i}", f"sort {i}") for i in range(7)], seed=3)
    return HubState(CFG, prompts, incarnation)


def group(actor_id: str, seq: int, credit_id: int, prompt_id: str, version: int) -> Group:
    traj = Trajectory(
        tokens=np.arange(6, dtype=np.int32),
        prompt_len=2,
        loss_mask=np.ones(4, np.uint8),
        behavior_logprobs=np.full(4, -0.5, np.float32),
        reward=float(seq),
        min_policy_version=version,
        max_policy_version=version,
        finish_reason="stop",
    )
    return Group.build(
        group_id=f"{actor_id}/{seq}",
        prompt_id=prompt_id,
        credit_id=credit_id,
        actor_id=actor_id,
        seq=seq,
        trajectories=[traj, traj],
    )


def push(state: HubState, holder: bytes, actor_id: str, seq: int, version: int) -> None:
    (item,) = state.issue(holder, 1)
    g = group(actor_id, seq, item.credit_id, item.prompt_id, version)
    state.store(holder, g, encode(g))


def workload(state: HubState) -> None:
    """Every kind of op: hellos, credits, stores, hand-outs, acks, versions, a dead actor."""
    state.begin(state.credits.incarnation)
    state.actor_hello(b"a", "a", session=11)
    state.actor_hello(b"b", "b", session=12)
    state.learner_hello(session=5, acks_batches=True)
    for seq in range(4):
        push(state, b"a", "a", seq, 0)
    push(state, b"b", "b", 0, 0)
    assert len(state.hand_out(1, 2, float("inf"))) == 2
    state.trained(1)
    state.adopt_version(1, rewind=True)
    assert len(state.hand_out(2, 2, float("inf"))) == 2  # lent, never acknowledged
    state.issue(b"b", 3)
    state.give_back(b"b", [state.credits.incarnation << 32 | state.credits._serial])
    state.expire(b"b")
    state.adopt_version(3)  # what is left goes stale
    push(state, b"a", "a", 4, 3)


def exported(state: HubState) -> tuple[Any, list[bytes]]:
    meta, groups = state.export()
    return meta, [b"".join(bytes(memoryview(f)) for f in encode(g)) for g in groups]


def write_log(tmp_path: Path) -> tuple[HubState, Path]:
    live = fresh()
    wal = WriteAheadLog(tmp_path, fsync=False, snapshot_log_bytes=1 << 30)
    wal.recover(live)
    live.journal = wal.journal
    workload(live)
    wal.close()
    return live, tmp_path / "wal-0.log"


def offsets(path: Path, log_id: int = 0) -> list[int]:
    """Where each record of a segment starts, then where the last one ends."""
    ends = [0]
    with path.open("rb") as f:
        try:
            for end, *_ in read_records(f, seed=log_id):
                ends.append(end)
        except TornRecord as exc:  # the end marker of a recycled segment
            assert exc.why == END_MARKER
    return ends


def disk_bytes(directory: Path) -> list[int]:
    """Sizes of the state files (the syncer thread may rename or delete one meanwhile)."""
    sizes = []
    for p in directory.iterdir():
        try:
            if p.name != "LOCK":
                sizes.append(p.stat().st_size)
        except FileNotFoundError:
            pass
    return sizes


def recover(tmp_path: Path) -> tuple[HubState, Any]:
    state = fresh(incarnation=2)
    wal = WriteAheadLog(tmp_path, fsync=False, snapshot_log_bytes=1 << 30)
    found = wal.recover(state)
    wal.close()
    return state, found


def big_group(actor_id: str, seq: int, credit_id: int, prompt_id: str) -> Group:
    """A group of about 80 KB whose arrays differ from seq to seq."""
    rng = np.random.default_rng(seq)
    trajs = [
        Trajectory(
            tokens=rng.integers(0, 50_000, 4096, dtype=np.int32),
            prompt_len=96,
            loss_mask=np.ones(4000, np.uint8),
            behavior_logprobs=-rng.random(4000, dtype=np.float32),
            reward=float(k),
            min_policy_version=0,
            max_policy_version=0,
            finish_reason="length",
        )
        for k in range(2)
    ]
    return Group.build(
        group_id=f"{actor_id}/{seq}",
        prompt_id=prompt_id,
        credit_id=credit_id,
        actor_id=actor_id,
        seq=seq,
        trajectories=trajs,
    )


def push_big(state: HubState, seq: int) -> int:
    """Store a big group from actor "a"; returns its encoded size."""
    (item,) = state.issue(b"a", 1)
    g = big_group("a", seq, item.credit_id, item.prompt_id)
    frames = encode(g)
    state.store(b"a", g, frames)
    return sum(memoryview(f).nbytes for f in frames)


def open_wal(tmp_path: Path, background: bool, **kw: Any) -> tuple[HubState, WriteAheadLog]:
    """A log in `tmp_path` and a state journaling to it, with actor "a" and a learner. Its
    snapshots reference only the segment they close unless `keep_segments` says otherwise."""
    state = fresh()
    wal = WriteAheadLog(
        tmp_path,
        fsync=True,
        background=background,
        snapshot_log_bytes=kw.get("snapshot_log_bytes", 1 << 30),
        keep_segments=kw.get("keep_segments", 1),
    )
    wal.recover(state)
    state.journal = wal.journal
    state.begin(1)
    state.actor_hello(b"a", "a", session=1)
    state.learner_hello(session=1, acks_batches=True)
    return state, wal


def snapshot_head(tmp_path: Path) -> dict[str, Any]:
    with (tmp_path / "snapshot.bin").open("rb") as f:
        _, op, head, _ = next(read_records(f))
    assert op == "snapshot"
    return head


def copy_state(src: Path, dst: Path) -> Path:
    dst.mkdir()
    for p in src.iterdir():
        if p.name != "LOCK":
            shutil.copy(p, dst / p.name)
    return dst


def names(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir())
