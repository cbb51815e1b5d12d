"""The messages of the reward-model server (`asyncrl reward-server`, actors/rewards/rm_server.py).

A client sends `ScoreRequest` (texts; the server tokenizes with the reward model's own
tokenizer, which need not be the policy's) and gets back `Scores` with one float32 per sample,
or an `Error` carrying the same `request_id` and naming the field at fault. `StatsRequest` is
answered with `Stats` (the server's counters). They travel like every other asyncrl message:
msgpack header + raw array frames (asyncrl/protocol.py), golden bytes in
tests/unit/golden_wire.py. Defined apart from asyncrl/messages.py, which lists them in
`MESSAGE_TYPES`, so that module stays about the hub.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

import numpy as np

SCORE_ERROR_CODES = ("bad_message", "bad_request", "overloaded", "timeout", "model_error")
"""`Error.code` values of the reward-model server; `overloaded` and `timeout` are worth a retry."""


@dataclass(frozen=True, kw_only=True)
class ScoreRequest:
    """Score `prompts[i] + completions[i]` for every i with the served reward model."""

    TYPE: ClassVar[str] = "ScoreRequest"
    request_id: int  # chosen by the client; echoed by the reply (Scores or Error)
    prompts: list[str]
    completions: list[str]  # as many as prompts
    timeout_s: float = 0.0  # longest wait in the server's queue; 0 = the server's default


@dataclass(frozen=True, kw_only=True)
class Scores:
    """The reward model's scalar for every sample of a `ScoreRequest`, in request order."""

    TYPE: ClassVar[str] = "Scores"
    request_id: int
    scores: np.ndarray = field(metadata={"dtype": "float32", "ndim": 1})  # float32 [n], finite
    model_dir: str  # the checkpoint that scored (provenance)
    model_hash: str  # sha256 prefix of its config.json and weight files
    queue_s: float = 0.0  # longest time one of the samples waited for a batch
    compute_s: float = 0.0  # model time of the batches that carried the samples
