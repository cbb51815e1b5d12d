"""The engine seam: what every generation engine (torch, vllm) offers the actor loop.

An engine turns prompt token ids into sampled completions with the per-token log-probability of
each sampled token under the distribution it was actually sampled from (after temperature and
top-p), as float32. It also swaps in new weights (`load_weights`) and reports the
`policy_version` of the weights it currently holds.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Literal, Protocol

import numpy as np
import torch


@dataclass(frozen=True, kw_only=True)
class GenerationRequest:
    """One prompt to sample `n` completions for."""

    prompt_tokens: Sequence[int]
    """Prompt token ids (bos included if the tokenizer adds one)."""
    n: int = 1
    """Completions to sample for this prompt."""
    temperature: float = 1.0
    """Sampling temperature (> 0)."""
    top_p: float = 1.0
    """Nucleus mass in (0, 1]."""
    max_new_tokens: int = 16
    """Completion length limit in tokens (the stop token counts)."""
    stop_token_ids: tuple[int, ...] = ()
    """Generation of a sample ends after emitting one of these (it is kept in the completion)."""
    seed: int | None = None
    """Seed for this request's sampling; None = engine's own stream."""
    cache_keys: tuple[str, ...] = ()
    """Keep each sample's KV cache under these keys when it finishes (one per sample; empty =
    keep nothing), for a later request to continue: engines that hold caches between calls
    (the torch engine) use them; others ignore them."""
    resume_key: str = ""
    """Continue the KV cache kept under this key when its tokens start `prompt_tokens` (and the
    weights are unchanged); otherwise the whole prompt is prefilled as usual."""


@dataclass(frozen=True, kw_only=True)
class Sample:
    """One sampled completion."""

    completion_tokens: np.ndarray
    """int32 [T]: the generated token ids (stop token included when hit)."""
    logprobs: np.ndarray
    """float32 [T]: log-prob of each generated token under the sampling distribution."""
    finish_reason: Literal["stop", "length"]
    """`stop` if a stop token ended it, `length` if max_new_tokens did."""
    policy_version: int = 0
    """Policy version of the weights that produced it (the first token's, see `versions`)."""
    extra: dict[str, float] = field(default_factory=dict)
    versions: np.ndarray | None = None
    """int32 [T]: the policy version that produced each token, when weights changed while the
    sample was being generated (in-flight updates); None = every token `policy_version`'s."""

    def token_versions(self) -> np.ndarray:
        """int32 [T]: the version behind each token (filled in when not recorded)."""
        if self.versions is not None:
            return self.versions
        return np.full(len(self.completion_tokens), self.policy_version, dtype=np.int32)


@dataclass(frozen=True, kw_only=True)
class Continue:
    """A turn handler's answer: the sequence goes on in the same generate call.

    `tokens` (the environment's, not sampled) are appended to the context after the turn that
    just ended, and the next turn is sampled from there with its own token budget and seed.
    """

    tokens: Sequence[int]
    """Token ids appended after the ended turn (may be empty)."""
    max_new_tokens: int
    """Token limit of the next turn (>= 1)."""
    seed: int | None = None
    """Sampling seed of the next turn; None = the engine's own stream."""


TurnHandler = Callable[[int, int, Sample], "Continue | Literal['keep', 'end']"]
"""`on_turn(request_index, sample_index, sample)` of engines that continue sequences within a
call (`supports_turns`): called as each sample's turn ends; answers `Continue(...)` to go on
now, "keep" to keep the sequence's KV cache under its `cache_keys` entry for a later call, or
"end"."""


class Engine(Protocol):
    """What the actor loop needs from a generation engine.

    In-flight weight updates: an engine that supports them has a `between_steps` attribute
    (a callable or None). During `generate` it calls it between decoding steps; the callable
    may call `load_weights`, and the sequences in flight continue under the new weights, every
    later token recording the new version (`Sample.versions`).
    """

    @property
    def policy_version(self) -> int:
        """Policy version of the weights currently loaded."""
        ...

    def generate(self, requests: Sequence[GenerationRequest]) -> list[list[Sample]]:
        """Sample `request.n` completions per request; result[i] belongs to requests[i]."""
        ...

    def load_weights(
        self, named_tensors: Iterable[tuple[str, torch.Tensor]], policy_version: int
    ) -> None:
        """Copy these Hugging Face-named tensors into the model; then hold `policy_version`."""
        ...

    def named_weights(self) -> list[tuple[str, torch.Tensor]]:
        """The weights the engine holds now, under Hugging Face names (CPU copies)."""
        ...

    def close(self) -> None:
        """Release the engine's resources."""
        ...
