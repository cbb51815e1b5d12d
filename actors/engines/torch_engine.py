"""The embedded default engine: batched sampling with a KV cache on a transformers causal LM.

One `generate` call samples every request's `n` completions as one batch:

```
  distinct prompts --left-pad--> prefill once (logits of the last position only)
        | repeat each prompt's KV cache n times (rows = requests x n)
        v
  +--> logits [rows, V] -> /temperature -> log_softmax -> top-p mask -> renormalise = log p
  |     sample: argmax(p / Exp(1) noise)    logprob = log p[token]  (float32)
  |     rows that hit a stop token or their max_new_tokens leave the batch (KV cache pruned)
  +---- forward the sampled tokens of the rows still running (one token each, cached)
```

KV caches across calls (multi-turn episodes): a request may name keys under which its samples'
caches are kept when they finish (`cache_keys`) and a kept cache to continue (`resume_key`);
the prefill then covers only the tokens after the cached ones (`KvStore`, "KV caches kept
between calls" below). Loading weights drops every kept cache.

In-flight weight updates: with `between_steps` set, the engine calls it after every sampled
token; when that call loaded new weights (`load_weights`), the KV cache of the rows still
running is recomputed under the new weights (one prefill over prompt + tokens so far), so each
later token is sampled from exactly the new version given its context, and its behaviour
logprob is that version's. The recompute costs one prefill per update and generate call
(`inflight_recompute_s` adds its seconds up); keeping the old cache would be free but make a
token's distribution a mix of two versions that no learner can recompute.

Prompts of different lengths share the batch through left padding, an attention mask and
position ids counted over real tokens only, so a row's logprobs do not depend on its
neighbours. Sampling noise comes from the request's own generator when `seed` is set (the
same seed gives the same samples whatever else is in the batch) and from the engine's
generator (seeded at construction) otherwise. Logprobs are those of the distribution actually
sampled from, after temperature and top-p, which is what importance correction needs.

The rows of one generate call (`DecodeRows`): what each sampled, for which turn, and its
noise. A row is one sample of one request (`request.n` rows per request). Every row still
running samples exactly one token per decoding step, so a row's turn is a contiguous range of
the call's steps: `[turn_start, end]`. Tokens and logprobs are written into [rows, steps] tables
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

KV caches kept between calls (`KvStore`), so a multi-turn episode's context is computed
once. A multi-turn episode asks the engine for each turn with its whole context (prompt, earlier
turns, observations). Without a cache kept between calls every turn prefills all of it again;
with one, a turn prefills only what is new since the last (the last sampled token and the
environment's observation). A request names where its rows' caches go when they finish
(`GenerationRequest.cache_keys`, one per sample) and which cache it continues
(`resume_key`); the torch engine keeps them here:

```
  turn k:   prefill([cached KV of resume_key] + new tokens) -> decode -> rows finish
                                                                     |
            KvStore[cache_keys[i]] = (tokens whose KV is held, per-layer K/V)  <-+
  turn k+1: take(resume_key): used only if its tokens are a prefix of the new context and it
            was computed by the weights loaded now (new weights make every entry stale)
```

An entry is used once (taking it removes it); the oldest entries are evicted beyond
`max_entries`, and `release` drops the entries of episodes that ended.
"""

from __future__ import annotations

import collections
import time
from collections.abc import Callable, Container, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, DynamicCache, PreTrainedModel

from actors.engines.base import Continue, GenerationRequest, Sample, TurnHandler
from asyncrl.weights.hf_layout import checkpoint_tensors

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class TorchEngine:
    """`Engine` over a Hugging Face causal LM on the local device (CPU by default)."""

    def __init__(
        self,
        model_dir: Path,
        *,
        dtype: str = "float32",
        num_threads: int | None = None,
        seed: int = 0,
    ) -> None:
        if dtype not in _DTYPES:
            raise ValueError(f"dtype: must be one of {list(_DTYPES)}, got {dtype!r}")
        if num_threads is not None:
            torch.set_num_threads(num_threads)  # process-wide: the engine owns its process
        tokenizer = AutoTokenizer.from_pretrained(model_dir)
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=_DTYPES[dtype])
        self._setup(model, tokenizer, seed)

    @classmethod
    def from_model(cls, model: PreTrainedModel, tokenizer: object, *, seed: int = 0) -> TorchEngine:
        """An engine sampling from `model` itself (shared, not copied): in-process training."""
        engine = cls.__new__(cls)
        engine._setup(model, tokenizer, seed)
        return engine

    def _setup(self, model: PreTrainedModel, tokenizer: object, seed: int) -> None:
        self.model = model.eval()
        self.tokenizer = tokenizer
        self._device = next(model.parameters()).device
        self._generator = torch.Generator(device=self._device).manual_seed(seed)
        self._pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
        # checkpoint names (MoE experts one by one, as views into the fused parameters)
        self._params = dict(checkpoint_tensors(model.named_parameters(remove_duplicate=False)))
        self._policy_version = 0
        self.between_steps: Callable[[], None] | None = None
        """Called between decoding steps (in-flight weight updates; see the module doc)."""
        self.inflight_recompute_s = 0.0
        """Seconds spent recomputing KV caches after in-flight weight updates."""
        self.inflight_updates = 0
        """Weight updates applied while sequences were in flight."""
        self.kv = KvStore()
        """KV caches kept between calls for requests that name `cache_keys`."""
        self.supports_kv_reuse = True
        self.supports_turns = True
        """`generate` takes `on_turn` (sequences continue within a call)."""

    @property
    def policy_version(self) -> int:
        """Policy version of the weights currently loaded."""
        return self._policy_version

    @property
    def stop_token_ids(self) -> tuple[int, ...]:
        """The tokenizer's end-of-sequence id(s): the usual `GenerationRequest.stop_token_ids`."""
        eos = self.tokenizer.eos_token_id
        return tuple(eos) if isinstance(eos, (list, tuple)) else (int(eos),)

    def encode(self, text: str) -> list[int]:
        """Prompt token ids of `text` (special tokens such as bos added as the tokenizer does)."""
        return list(self.tokenizer(text)["input_ids"])

    def decode(self, tokens: Sequence[int]) -> str:
        """Text of completion tokens (special tokens kept, so an end marker stays visible)."""
        return self.tokenizer.decode(list(tokens), skip_special_tokens=False)

    def close(self) -> None:
        """Drop the model (the engine is unusable afterwards)."""
        self._params = {}
        self.model = None

    # ---------------------------------------------------------------- weights

    def load_weights(
        self, named_tensors: Iterable[tuple[str, torch.Tensor]], policy_version: int
    ) -> None:
        """Copy Hugging Face-named tensors in place; all are checked before any is copied."""
        updates = list(named_tensors)
        for name, tensor in updates:
            if name not in self._params:
                raise ValueError(f"load_weights: unknown tensor {name!r}")
            expected = tuple(self._params[name].shape)
            if tuple(tensor.shape) != expected:
                raise ValueError(
                    f"load_weights: {name!r} has shape {tuple(tensor.shape)}, expected {expected}"
                )
        with torch.no_grad():
            for name, tensor in updates:
                self._params[name].copy_(tensor)
        self._policy_version = int(policy_version)
        self.kv.clear()  # computed by the old weights

    def named_weights(self) -> list[tuple[str, torch.Tensor]]:
        """The weights the model holds now, under Hugging Face names, as CPU copies.

        Named as `model.named_parameters()` names them (a tied head appears once, as its
        embedding), which is what a trainer's digest of the same model covers.
        """
        with torch.no_grad():
            return [
                (name, p.detach().to("cpu", copy=True)) for name, p in self.model.named_parameters()
            ]

    # ---------------------------------------------------------------- sampling

    def generate(
        self, requests: Sequence[GenerationRequest], on_turn: TurnHandler | None = None
    ) -> list[list[Sample]]:
        """Sample `request.n` completions per request; result[i] belongs to requests[i].

        With `on_turn`, each sample's turn is handed over as it ends and may continue in this
        call (`Continue`: multi-turn episodes without leaving the decoding loop); the result
        then holds each sample's last turn.
        """
        if not requests:
            return []
        for i, req in enumerate(requests):
            _check_request(i, req)
        with torch.inference_mode():
            rows = self._decode(requests, on_turn)
        return rows.results()

    def _decode(
        self, requests: Sequence[GenerationRequest], on_turn: TurnHandler | None
    ) -> DecodeRows:
        rows = DecodeRows(requests, self._device)
        cache, logits, mask = self._prefill_reusing(requests)
        cache.batch_select_indices(rows.row_req)
        logits, mask = logits[rows.row_req], mask[rows.row_req]
        positions = mask.sum(dim=1, keepdim=True) - 1
        active = torch.arange(rows.num_rows, device=self._device)  # rows in the batch, in order
        parked: dict[int, list[int]] = {}  # continued rows: the input their next turn starts with
        step = 0
        while True:
            noise = rows.noise(self._generator, logits.shape[-1], skip=parked)[active]
            token, logprob = _sample(logits, rows.temps[active], rows.top_ps[active], noise)
            live = _not_in(active, parked)
            rows.record(active[live], step, token[live], logprob[live], self._policy_version)
            stopped, ended = rows.turn_ends(active, step, token)
            ended &= live
            keep = ~ended
            for pos in ended.nonzero().squeeze(1).tolist():
                row = int(active[pos])
                verdict = self._end_turn(rows, row, step, bool(stopped[pos]), on_turn)
                if isinstance(verdict, Continue):
                    keep[pos], parked[row] = True, [int(token[pos]), *verdict.tokens]
                elif verdict == "keep" and rows.cache_key(row):
                    tokens = rows.context(row, step)  # the last token is not in the cache yet
                    entry = row_entry(cache, pos, mask[pos], tokens, self._policy_version)
                    self.kv.save(rows.cache_key(row), entry)
            if not bool(keep.any()):
                return rows
            if not bool(keep.all()):
                cache.batch_select_indices(keep.nonzero().squeeze(1))
                active, token, mask, positions = (
                    active[keep],
                    token[keep],
                    mask[keep],
                    positions[keep],
                )
            step += 1
            version = self._policy_version
            if self.between_steps is not None:
                self.between_steps()
            if self._policy_version != version:  # new weights: recompute the cache under them
                cache, logits, mask = self._recompute(
                    [rows.context(int(r), step) for r in active.tolist()]
                )
                positions = mask.sum(dim=1, keepdim=True) - 1
                rows.start_turns(parked, step)
                parked.clear()
                continue
            flush = 2 * len(parked) >= len(active)  # enough continued rows wait: feed them all
            ids, new_mask, positions = _next_inputs(active, token, positions, parked, flush)
            if flush:
                rows.start_turns(parked, step)
                parked.clear()
            mask = torch.cat([mask, new_mask], dim=1)
            logits = self._forward(ids, mask, positions, cache)
            positions = positions[:, -1:]

    def _end_turn(
        self, rows: DecodeRows, row: int, step: int, stopped: bool, on_turn: TurnHandler | None
    ) -> Continue | str:
        """The verdict on a row whose turn ended: continue it now, keep its cache, or end."""
        sample = rows.end_turn(row, step, stopped)
        if on_turn is None:
            return "keep"
        verdict = on_turn(*rows.member(row), sample)
        if isinstance(verdict, Continue):
            rows.continue_turn(row, step, verdict)
        elif verdict not in ("keep", "end"):
            raise ValueError(f"on_turn: must return Continue, 'keep' or 'end', got {verdict!r}")
        return verdict

    def _recompute(
        self, contexts: list[list[int]]
    ) -> tuple[DynamicCache, torch.Tensor, torch.Tensor]:
        """A fresh KV cache of the running rows' contexts under the weights loaded now, the
        logits of their next token and the attention mask (rows in order)."""
        start = time.perf_counter()
        cache = DynamicCache(config=self.model.config)
        logits, mask = self._prefill([GenerationRequest(prompt_tokens=c) for c in contexts], cache)
        self.inflight_recompute_s += time.perf_counter() - start
        self.inflight_updates += 1
        return cache, logits, mask

    def _prefill_reusing(
        self, requests: Sequence[GenerationRequest]
    ) -> tuple[DynamicCache, torch.Tensor, torch.Tensor]:
        """`_prefill`, continuing kept caches where requests name usable ones: the cached
        tokens right-aligned, then each request's new tokens left-padded after them."""
        entries = [
            self.kv.take(r.resume_key, r.prompt_tokens, self._policy_version) for r in requests
        ]
        if all(e is None for e in entries):
            cache = DynamicCache(config=self.model.config)
            logits, mask = self._prefill(requests, cache)
            return cache, logits, mask
        num_layers = self.model.config.num_hidden_layers
        cache, cached_mask, lengths = batched_cache(entries, num_layers, self.model.config)
        rest = [list(r.prompt_tokens)[n:] for r, n in zip(requests, lengths, strict=True)]
        width = max(len(t) for t in rest)
        ids = torch.full((len(requests), width), self._pad_id, dtype=torch.long)
        new_mask = torch.zeros((len(requests), width), dtype=torch.long)
        positions = torch.zeros((len(requests), width), dtype=torch.long)
        for i, (tokens, n) in enumerate(zip(rest, lengths, strict=True)):
            ids[i, width - len(tokens) :] = torch.as_tensor(tokens, dtype=torch.long)
            new_mask[i, width - len(tokens) :] = 1
            positions[i, width - len(tokens) :] = torch.arange(n, n + len(tokens))
        mask = torch.cat([cached_mask, new_mask.to(self._device)], dim=1)
        logits = self._forward(ids.to(self._device), mask, positions.to(self._device), cache)
        return cache, logits, mask

    def release(self, keys: Sequence[str]) -> None:
        """Forget the caches kept under these keys (their sequences will not continue)."""
        self.kv.release(keys)

    def _prefill(
        self, requests: Sequence[GenerationRequest], cache: DynamicCache
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Left-padded forward over each request's prompt; last-position logits and the mask."""
        width = max(len(r.prompt_tokens) for r in requests)
        ids = torch.full((len(requests), width), self._pad_id, dtype=torch.long)
        mask = torch.zeros((len(requests), width), dtype=torch.long)
        for i, req in enumerate(requests):
            prompt = torch.as_tensor(list(req.prompt_tokens), dtype=torch.long)
            ids[i, width - len(prompt) :] = prompt
            mask[i, width - len(prompt) :] = 1
        ids, mask = ids.to(self._device), mask.to(self._device)
        positions = (mask.cumsum(dim=1) - 1).clamp(min=0)
        return self._forward(ids, mask, positions, cache), mask

    def _forward(
        self, ids: torch.Tensor, mask: torch.Tensor, positions: torch.Tensor, cache: DynamicCache
    ) -> torch.Tensor:
        out = self.model(
            input_ids=ids,
            attention_mask=mask,
            position_ids=positions,
            past_key_values=cache,
            use_cache=True,
            logits_to_keep=1,
        )
        return out.logits[:, -1, :].float()


def process_logits(
    logits: torch.Tensor, temperature: torch.Tensor, top_p: torch.Tensor
) -> torch.Tensor:
    """Log-probabilities [rows, V] of the sampling distribution: temperature, then top-p.

    Top-p keeps the smallest set of most likely tokens whose mass reaches `top_p` (the most
    likely token always) and renormalises over it; removed tokens get -inf.
    """
    logp = torch.log_softmax(logits.float() / temperature.unsqueeze(1), dim=-1)
    if bool((top_p >= 1.0).all()):
        return logp
    sorted_logp, order = logp.sort(dim=-1, descending=True)
    sorted_p = sorted_logp.exp()
    mass_before = sorted_p.cumsum(dim=-1) - sorted_p
    remove_sorted = mass_before >= top_p.unsqueeze(1)
    remove = torch.zeros_like(remove_sorted).scatter(1, order, remove_sorted)
    logp = logp.masked_fill(remove, float("-inf"))
    return logp - torch.logsumexp(logp, dim=-1, keepdim=True)


def _sample(
    logits: torch.Tensor, temperature: torch.Tensor, top_p: torch.Tensor, noise: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Exponential-race sampling: argmax(p / E) with E ~ Exp(1) draws exactly from p."""
    logp = process_logits(logits, temperature, top_p)
    token = (logp - noise.clamp_min(1e-30).log()).argmax(dim=-1)  # no nan from -inf + inf
    return token, logp.gather(1, token.unsqueeze(1)).squeeze(1)


def _not_in(active: torch.Tensor, rows: dict[int, list[int]]) -> torch.Tensor:
    """bool [A]: which of the batch's rows are not among `rows`."""
    if not rows:
        return torch.ones(len(active), dtype=torch.bool, device=active.device)
    return ~torch.isin(active, torch.tensor(list(rows), device=active.device))


def _next_inputs(
    active: torch.Tensor,
    token: torch.Tensor,
    positions: torch.Tensor,
    parked: dict[int, list[int]],
    flush: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The next forward's input ids, new mask columns and positions [A, W].

    Each running row feeds its sampled token. A continued row waits (`parked`: a masked pad
    column, its position unchanged) until `flush`, when it feeds its last sampled token and the
    tokens its environment appended in one go, right-aligned (the padding on the left masked).
    Feeding continued rows together keeps the forward one token wide on most steps.
    """
    if not parked:
        return token.unsqueeze(1), torch.ones_like(token).unsqueeze(1), positions + 1
    waiting = ~_not_in(active, parked)
    if not flush:
        ids = token.masked_fill(waiting, 0).unsqueeze(1)
        step = (~waiting).long().unsqueeze(1)
        return ids, step, positions + step
    rows = active.tolist()
    width = max(len(t) for t in parked.values())
    ids = torch.zeros((len(rows), width), dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    pos = torch.zeros((len(rows), width), dtype=torch.long)
    tokens, last = token.tolist(), positions.squeeze(1).tolist()
    for i, row in enumerate(rows):
        seq = parked.get(row, [tokens[i]])
        ids[i, width - len(seq) :] = torch.tensor(seq, dtype=torch.long)
        mask[i, width - len(seq) :] = 1
        pos[i, width - len(seq) :] = torch.arange(last[i] + 1, last[i] + 1 + len(seq))
    dev = token.device
    return ids.to(dev), mask.to(dev), pos.to(dev)


def _check_request(index: int, req: GenerationRequest) -> None:
    where = f"requests[{index}]"
    if req.n < 1:
        raise ValueError(f"{where}.n: must be >= 1, got {req.n}")
    if not req.temperature > 0:
        raise ValueError(f"{where}.temperature: must be > 0, got {req.temperature}")
    if not 0 < req.top_p <= 1:
        raise ValueError(f"{where}.top_p: must be in (0, 1], got {req.top_p}")
    if req.max_new_tokens < 1:
        raise ValueError(f"{where}.max_new_tokens: must be >= 1, got {req.max_new_tokens}")
    if len(req.prompt_tokens) < 1:
        raise ValueError(f"{where}.prompt_tokens: must not be empty")


# --- the rows of one generate call ---------------------------------------------------------------

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


# --- KV caches kept between calls ----------------------------------------------------------------


@dataclass(frozen=True)
class KvEntry:
    """The KV cache of one sequence: its tokens and, per layer, keys and values [H, L, D]."""

    tokens: tuple[int, ...]
    layers: tuple[tuple[torch.Tensor, torch.Tensor], ...]
    version: int


class KvStore:
    """Per-sequence KV caches by key (see the module docstring)."""

    def __init__(self, max_entries: int = 4096) -> None:
        self.max_entries = max_entries
        self._entries: collections.OrderedDict[str, KvEntry] = collections.OrderedDict()
        self.hits = 0
        """Requests that continued a kept cache."""
        self.misses = 0
        """Requests that named a cache that was gone, stale or not a prefix of their context."""
        self.reused_tokens = 0
        """Prompt tokens not prefilled thanks to a kept cache."""

    def __len__(self) -> int:
        return len(self._entries)

    def take(self, key: str, prompt: Sequence[int], version: int) -> KvEntry | None:
        """The entry under `key` if it can continue `prompt` under weights `version` (it is
        removed either way)."""
        entry = self._entries.pop(key, None) if key else None
        if entry is None:
            self.misses += bool(key)
            return None
        n = len(entry.tokens)
        if entry.version != version or n >= len(prompt) or tuple(prompt[:n]) != entry.tokens:
            self.misses += 1
            return None
        self.hits += 1
        self.reused_tokens += n
        return entry

    def save(self, key: str, entry: KvEntry) -> None:
        self._entries.pop(key, None)
        self._entries[key] = entry
        while len(self._entries) > self.max_entries:
            self._entries.popitem(last=False)

    def release(self, keys: Iterable[str]) -> None:
        """Drop these entries (their sequences will not continue)."""
        for key in keys:
            self._entries.pop(key, None)

    def clear(self) -> None:
        """Drop everything (the weights changed)."""
        self._entries.clear()


def batched_cache(
    entries: Sequence[KvEntry | None], num_layers: int, config: object
) -> tuple[DynamicCache, torch.Tensor, list[int]]:
    """A DynamicCache holding each row's entry right-aligned (rows without one hold padding),
    its attention mask [R, C] and each row's cached length."""
    lengths = [len(e.tokens) if e is not None else 0 for e in entries]
    width = max(lengths)
    some = next(e for e in entries if e is not None)
    cache = DynamicCache(config=config)
    mask = torch.zeros((len(entries), width), dtype=torch.long, device=some.layers[0][0].device)
    for row, n in enumerate(lengths):
        mask[row, width - n :] = 1 if n else 0
    for layer in range(num_layers):
        k0, v0 = some.layers[layer]
        keys = k0.new_zeros((len(entries), k0.shape[0], width, k0.shape[2]))
        values = v0.new_zeros((len(entries), v0.shape[0], width, v0.shape[2]))
        for row, entry in enumerate(entries):
            if entry is not None:
                n = lengths[row]
                keys[row, :, width - n :] = entry.layers[layer][0]
                values[row, :, width - n :] = entry.layers[layer][1]
        cache.update(keys, values, layer)
    return cache, mask, lengths


def row_entry(
    cache: DynamicCache, row: int, mask_row: torch.Tensor, tokens: Sequence[int], version: int
) -> KvEntry:
    """Row `row` of a batched cache as an entry (padding columns removed)."""
    real = mask_row.bool()
    layers = tuple(
        (layer.keys[row][:, real].clone(), layer.values[row][:, real].clone())
        for layer in cache.layers
    )
    assert layers[0][0].shape[1] == len(tokens), (layers[0][0].shape, len(tokens))
    return KvEntry(tokens=tuple(int(t) for t in tokens), layers=layers, version=version)
