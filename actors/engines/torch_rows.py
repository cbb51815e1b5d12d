"""The rows of one torch-engine generate call: what each sampled, for which turn, and its noise.

A row is one sample of one request (`request.n` rows per request). Every row still running
samples exactly one token per decoding step, so a row's turn is a contiguous range of the
call's steps: `[turn_start, end]`. Tokens and logprobs are written into [rows, steps] tables
that grow when a row continues past its first turn (continuation: the row's episode goes on
with the environment's tokens appended, in the same decoding loop).

```
  step s: sample -> record(active, s) -> rows that stop or hit their limit end their turn
          end_turn(row, s) -> Sample (tokens[turn_start..s]) -> the caller's verdict:
             Continue(tokens, max_new_tokens, seed) -> continue_turn: the row stays, its
                                                       context grows, its budget and seed reset;
                                                       it waits, then start_turns(step)
             "keep" / "end"                        -> the row leaves the batch
```

Sampling noise: seeded requests draw [n, V] Exp(1) noise per step from their own generator
(all n rows, finished or not, so a request's stream never depends on when its rows stop); a
continued row with a seed draws from a generator of its own turn seed, as a fresh request of
n = 1 with that seed would; everything else draws from the engine's generator.
"""

from __future__ import annotations

from collections.abc import Container, Iterable, Sequence

import numpy as np
import torch

from actors.engines.base import Continue, GenerationRequest, Sample

WAITING = 1 << 62
"""`turn_start` of a continued row that has not started its next turn yet."""


class DecodeRows:
    """Per-row state of one generate call (see the module docstring)."""

    def __init__(self, requests: Sequence[GenerationRequest], device: torch.device) -> None:
        self.requests = requests
        self.device = device
        counts = [r.n for r in requests]
        self.row_req = torch.repeat_interleave(
            torch.arange(len(requests), device=device), torch.tensor(counts, device=device)
        )
        self.num_rows = len(self.row_req)
        self.first_row = np.cumsum([0, *counts[:-1]]).tolist()
        """Row index of each request's first sample."""
        self.row_req_list: list[int] = self.row_req.tolist()
        self.temps = torch.tensor([r.temperature for r in requests], device=device)[self.row_req]
        self.top_ps = torch.tensor([r.top_p for r in requests], device=device)[self.row_req]
        self.row_max = torch.tensor([r.max_new_tokens for r in requests], device=device)
        self.row_max = self.row_max[self.row_req]
        self.stop_table = stop_table(requests, device)[self.row_req]
        self.turn_start = torch.zeros(self.num_rows, dtype=torch.long, device=device)
        self.base: list[list[int] | None] = [None] * self.num_rows
        """A continued row's context before its current turn (None: its request's prompt)."""
        self.seeded = {
            i: torch.Generator(device=device).manual_seed(int(r.seed))
            for i, r in enumerate(requests)
            if r.seed is not None
        }
        self.row_gens: dict[int, torch.Generator] = {}
        width = max(r.max_new_tokens for r in requests)
        self.tokens = torch.zeros((self.num_rows, width), dtype=torch.long, device=device)
        self.logprobs = torch.zeros((self.num_rows, width), dtype=torch.float32, device=device)
        self.step_versions: list[int] = []
        """The policy version that sampled each step's tokens."""
        self.last: list[Sample | None] = [None] * self.num_rows

    # --- recording ----------------------------------------------------------------------

    def record(
        self,
        active: torch.Tensor,
        step: int,
        token: torch.Tensor,
        logprob: torch.Tensor,
        version: int,
    ) -> None:
        """Step `step`'s tokens of the running rows."""
        if step >= self.tokens.shape[1]:
            grow = self.tokens.shape[1]
            self.tokens = torch.cat([self.tokens, torch.zeros_like(self.tokens[:, :grow])], 1)
            self.logprobs = torch.cat([self.logprobs, torch.zeros_like(self.logprobs[:, :grow])], 1)
        self.tokens[active, step], self.logprobs[active, step] = token, logprob
        self.step_versions.append(version)

    def turn_ends(
        self, active: torch.Tensor, step: int, token: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(stopped, ended) over the running rows after step `step`: a stop token, or the
        turn's token budget spent."""
        stopped = (token.unsqueeze(1) == self.stop_table[active]).any(dim=1)
        spent = step + 1 - self.turn_start[active] >= self.row_max[active]
        return stopped, stopped | spent

    def end_turn(self, row: int, step: int, stopped: bool) -> Sample:
        """The row's turn that ended at `step`, as a Sample (also kept as the row's last)."""
        start = int(self.turn_start[row])
        versions = self.step_versions[start : step + 1]
        varied = any(v != versions[0] for v in versions)
        sample = Sample(
            completion_tokens=self.tokens[row, start : step + 1].cpu().numpy().astype(np.int32),
            logprobs=self.logprobs[row, start : step + 1].cpu().numpy().copy(),
            finish_reason="stop" if stopped else "length",
            policy_version=versions[0],
            versions=np.asarray(versions, dtype=np.int32) if varied else None,
        )
        self.last[row] = sample
        return sample

    def continue_turn(self, row: int, step: int, nxt: Continue) -> None:
        """The row goes on: its context gains the ended turn and `nxt.tokens`."""
        if nxt.max_new_tokens < 1:
            raise ValueError(f"Continue.max_new_tokens: must be >= 1, got {nxt.max_new_tokens}")
        self.base[row] = [*self.context(row, step + 1), *nxt.tokens]
        self.turn_start[row] = WAITING  # until start_turns: the context is `base`
        self.row_max[row] = nxt.max_new_tokens
        if nxt.seed is not None:
            self.row_gens[row] = torch.Generator(device=self.device).manual_seed(int(nxt.seed))
        else:
            self.row_gens.pop(row, None)

    def start_turns(self, rows: Iterable[int], step: int) -> None:
        """Continued rows sample their next turn from step `step` on."""
        for row in rows:
            self.turn_start[row] = step

    # --- reading ------------------------------------------------------------------------

    def context(self, row: int, upto: int) -> list[int]:
        """The row's tokens: its context before this turn and the turn's tokens before step
        `upto` (after `continue_turn`, the whole context including the appended tokens)."""
        start = int(self.turn_start[row])
        before = self.base[row]
        if before is None:
            before = list(self.requests[self.row_req_list[row]].prompt_tokens)
        return [*before, *self.tokens[row, start:upto].tolist()] if upto > start else before

    def cache_key(self, row: int) -> str:
        """Where the row's KV cache is kept when it leaves ("" when its request keeps none)."""
        request_index = self.row_req_list[row]
        keys = self.requests[request_index].cache_keys
        return keys[row - self.first_row[request_index]] if keys else ""

    def member(self, row: int) -> tuple[int, int]:
        """(request index, sample index within the request) of a row."""
        request_index = self.row_req_list[row]
        return request_index, row - self.first_row[request_index]

    def results(self) -> list[list[Sample]]:
        """Each request's samples: every row's last turn."""
        out: list[list[Sample]] = []
        for i, request in enumerate(self.requests):
            rows = self.last[self.first_row[i] : self.first_row[i] + request.n]
            assert all(s is not None for s in rows), "a row never ended its turn"
            out.append(list(rows))  # type: ignore[arg-type]
        return out

    def noise(
        self, generator: torch.Generator, vocab: int, skip: Container[int] = ()
    ) -> torch.Tensor:
        """Exp(1) noise [rows, V] for one step (see the module docstring); continued rows in
        `skip` (waiting to start their turn) do not advance their own streams."""
        noise = torch.empty((self.num_rows, vocab), device=self.device)
        noise.exponential_(generator=generator)
        for i, gen in self.seeded.items():
            start = self.first_row[i]
            block = torch.empty((self.requests[i].n, vocab), device=self.device)
            noise[start : start + self.requests[i].n] = block.exponential_(generator=gen)
        for row, gen in self.row_gens.items():
            if row in skip:
                continue
            noise[row] = torch.empty((1, vocab), device=self.device).exponential_(generator=gen)
        return noise


def stop_table(requests: Sequence[GenerationRequest], device: torch.device) -> torch.Tensor:
    """Stop ids per request [R, S], padded with -1 (never a token id)."""
    width = max(1, max(len(r.stop_token_ids) for r in requests))
    table = torch.full((len(requests), width), -1, dtype=torch.long)
    for i, req in enumerate(requests):
        table[i, : len(req.stop_token_ids)] = torch.tensor(req.stop_token_ids, dtype=torch.long)
    return table.to(device)
