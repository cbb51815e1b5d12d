"""`Trajectory` (one sample, as an actor builds it) and `Group` (all samples of one prompt, the
unit of storage and sampling): columnar, token-level arrays concatenated over the trajectories,
scalars as lists. Listed with every other message in asyncrl/messages.py."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

import numpy as np

from asyncrl.message_fields import appended_field, array_field


@dataclass(frozen=True, kw_only=True)
class Trajectory:
    """One sample of a group, as the actor builds it (not a wire message by itself)."""

    tokens: np.ndarray  # int32 [L]: prompt + completion
    prompt_len: int
    loss_mask: np.ndarray  # uint8 [L - prompt_len]: 1 where the model produced the token
    behavior_logprobs: np.ndarray  # float32 [L - prompt_len]: 0 where loss_mask is 0
    reward: float
    min_policy_version: int
    max_policy_version: int
    finish_reason: str
    trajectory_id: str = ""
    reward_failed: str = ""  # why the reward could not be computed ("" = it was)
    num_turns: int = 1  # model turns of the episode
    tool_s: float = 0.0  # seconds the episode spent in tool calls
    env_s: float = 0.0  # seconds the episode spent in the environment (tools included)
    version_spans: tuple[int, ...] = ()
    """Flat (first completion token, policy version) pairs, one per version the trajectory
    spans, in order; empty = not recorded: every token counts as `min_policy_version`'s (the
    oldest, as the hub's bound does)."""

    @property
    def completion_tokens(self) -> np.ndarray:
        return self.tokens[self.prompt_len :]

    def token_versions(self) -> np.ndarray:
        """int32 [L - prompt_len]: the policy version behind each completion token (tokens an
        environment added carry the version of the model turn before them)."""
        out = np.full(len(self.tokens) - self.prompt_len, self.min_policy_version, np.int32)
        spans = self.version_spans
        for i in range(0, len(spans), 2):
            out[spans[i] :] = spans[i + 1]
        return out


@dataclass(frozen=True, kw_only=True)
class Group:
    """All samples of one prompt, the unit of storage and sampling (columnar on the wire)."""

    TYPE: ClassVar[str] = "Group"
    group_id: str
    prompt_id: str
    credit_id: int
    actor_id: str
    seq: int  # per-actor monotonic, for dedup of resends
    trajectory_ids: list[str]
    seq_lens: list[int]  # L_i = prompt_len_i + completion_len_i
    prompt_lens: list[int]
    rewards: list[float]
    min_policy_versions: list[int]
    max_policy_versions: list[int]
    finish_reasons: list[str]
    reward_failed: list[str]
    tokens: np.ndarray = array_field("int32")  # concat over trajectories of L_i tokens
    loss_mask: np.ndarray = array_field("uint8")  # concat of completion masks
    behavior_logprobs: np.ndarray = array_field("float32")  # concat of completion logprobs
    metadata: dict[str, Any] = field(default_factory=dict)
    timings: dict[str, float] = field(default_factory=dict)
    # per trajectory, or empty = not recorded (single-turn groups leave them off the wire)
    num_turns: list[int] = appended_field(factory=list)
    tool_s: list[float] = appended_field(factory=list)
    env_s: list[float] = appended_field(factory=list)
    # trajectories made by several policy versions (in-flight updates, multi-turn episodes):
    # flat (trajectory index, first completion token, version) triples; see Trajectory
    version_spans: list[int] = appended_field(factory=list)
    # reward component name -> one value per trajectory (finite floats); {} = not recorded
    reward_components: dict[str, list[float]] = appended_field(factory=dict)

    @property
    def size(self) -> int:
        return len(self.seq_lens)

    @property
    def min_policy_version(self) -> int:
        """The oldest policy that contributed a token: staleness is measured from it."""
        return min(self.min_policy_versions)

    @property
    def max_policy_version(self) -> int:
        return max(self.max_policy_versions)

    @property
    def nbytes(self) -> int:
        return self.tokens.nbytes + self.loss_mask.nbytes + self.behavior_logprobs.nbytes

    def trajectories(self) -> list[Trajectory]:
        """Per-sample views into the columnar arrays (no copies)."""
        spans: dict[int, list[int]] = {}
        flat = self.version_spans
        for i in range(0, len(flat), 3):
            spans.setdefault(flat[i], []).extend(flat[i + 1 : i + 3])
        out: list[Trajectory] = []
        tok = comp = 0
        for i, (length, plen) in enumerate(zip(self.seq_lens, self.prompt_lens, strict=True)):
            clen = length - plen
            out.append(
                Trajectory(
                    tokens=self.tokens[tok : tok + length],
                    prompt_len=plen,
                    loss_mask=self.loss_mask[comp : comp + clen],
                    behavior_logprobs=self.behavior_logprobs[comp : comp + clen],
                    reward=self.rewards[i],
                    min_policy_version=self.min_policy_versions[i],
                    max_policy_version=self.max_policy_versions[i],
                    finish_reason=self.finish_reasons[i],
                    trajectory_id=self.trajectory_ids[i],
                    reward_failed=self.reward_failed[i],
                    num_turns=self.num_turns[i] if self.num_turns else 1,
                    tool_s=self.tool_s[i] if self.tool_s else 0.0,
                    env_s=self.env_s[i] if self.env_s else 0.0,
                    version_spans=tuple(spans.get(i, ())),
                )
            )
            tok += length
            comp += clen
        return out

    @classmethod
    def build(
        cls,
        *,
        group_id: str,
        prompt_id: str,
        credit_id: int,
        actor_id: str,
        seq: int,
        trajectories: Sequence[Trajectory],
        metadata: dict[str, Any] | None = None,
        timings: dict[str, float] | None = None,
        reward_components: dict[str, list[float]] | None = None,
    ) -> Group:
        """Concatenate per-sample trajectories into the columnar group."""
        if not trajectories:
            raise ValueError("a group needs at least one trajectory")
        return cls(
            group_id=group_id,
            prompt_id=prompt_id,
            credit_id=credit_id,
            actor_id=actor_id,
            seq=seq,
            trajectory_ids=[
                t.trajectory_id or f"{group_id}/{i}" for i, t in enumerate(trajectories)
            ],
            seq_lens=[int(t.tokens.shape[0]) for t in trajectories],
            prompt_lens=[int(t.prompt_len) for t in trajectories],
            rewards=[float(t.reward) for t in trajectories],
            min_policy_versions=[int(t.min_policy_version) for t in trajectories],
            max_policy_versions=[int(t.max_policy_version) for t in trajectories],
            finish_reasons=[t.finish_reason for t in trajectories],
            reward_failed=[t.reward_failed for t in trajectories],
            tokens=np.concatenate([np.asarray(t.tokens, np.int32) for t in trajectories]),
            loss_mask=np.concatenate([np.asarray(t.loss_mask, np.uint8) for t in trajectories]),
            behavior_logprobs=np.concatenate(
                [np.asarray(t.behavior_logprobs, np.float32) for t in trajectories]
            ),
            metadata=dict(metadata or {}),
            timings=dict(timings or {}),
            **_episode_lists(trajectories),
            version_spans=[
                x
                for i, t in enumerate(trajectories)
                for j in range(0, len(t.version_spans), 2)
                for x in (i, *t.version_spans[j : j + 2])
            ],
            reward_components={
                k: [float(v) for v in vs] for k, vs in (reward_components or {}).items()
            },
        )


def _episode_lists(trajectories: Sequence[Trajectory]) -> dict[str, list]:
    """The per-trajectory episode fields, or none when every trajectory has the defaults."""
    if all(t.num_turns == 1 and t.tool_s == 0.0 and t.env_s == 0.0 for t in trajectories):
        return {}
    return {
        "num_turns": [int(t.num_turns) for t in trajectories],
        "tool_s": [float(t.tool_s) for t in trajectories],
        "env_s": [float(t.env_s) for t in trajectories],
    }
