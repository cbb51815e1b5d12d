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
the prefill then covers only the tokens after the cached ones (actors/engines/kv_store.py).
Loading weights drops every kept cache.

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
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path

import numpy as np
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, DynamicCache, PreTrainedModel

from actors.engines.base import GenerationRequest, Sample
from actors.engines.kv_store import KvStore, batched_cache, row_entry
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

    def generate(self, requests: Sequence[GenerationRequest]) -> list[list[Sample]]:
        """Sample `request.n` completions per request; result[i] belongs to requests[i]."""
        if not requests:
            return []
        for i, req in enumerate(requests):
            _check_request(i, req)
        with torch.inference_mode():
            tokens, logprobs, lengths, stopped, versions = self._sample_batch(requests)
        return self._to_samples(requests, tokens, logprobs, lengths, stopped, versions)

    def _sample_batch(
        self, requests: Sequence[GenerationRequest]
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
        dev = self._device
        row_req = torch.repeat_interleave(
            torch.arange(len(requests), device=dev),
            torch.tensor([r.n for r in requests], device=dev),
        )
        num_rows, max_new = len(row_req), max(r.max_new_tokens for r in requests)
        temps = torch.tensor([r.temperature for r in requests], device=dev)[row_req]
        top_ps = torch.tensor([r.top_p for r in requests], device=dev)[row_req]
        row_max = torch.tensor([r.max_new_tokens for r in requests], device=dev)[row_req]
        stop_table = _stop_table(requests, dev)[row_req]
        seeded = {
            i: _request_generator(r, dev) for i, r in enumerate(requests) if r.seed is not None
        }

        keeping = any(r.cache_keys for r in requests)
        cache, logits, mask = self._prefill_reusing(requests)
        cache.batch_select_indices(row_req)
        logits, mask = logits[row_req], mask[row_req]
        positions = mask.sum(dim=1, keepdim=True) - 1

        out_tokens = torch.full((num_rows, max_new), self._pad_id, dtype=torch.long, device=dev)
        out_logprobs = torch.zeros((num_rows, max_new), dtype=torch.float32, device=dev)
        lengths = torch.zeros(num_rows, dtype=torch.long, device=dev)
        stopped = torch.zeros(num_rows, dtype=torch.bool, device=dev)
        active = torch.arange(num_rows, device=dev)  # rows still running, in batch order
        versions = None  # [rows, max_new] once weights change mid-generation
        for step in range(max_new):
            noise = self._noise(row_req, seeded, logits.shape[-1])[active]
            token, logprob = _sample(logits, temps[active], top_ps[active], noise)
            out_tokens[active, step], out_logprobs[active, step] = token, logprob
            if versions is not None:
                versions[active, step] = self._policy_version
            lengths[active] = step + 1
            hit_stop = (token.unsqueeze(1) == stop_table[active]).any(dim=1)
            stopped[active] = hit_stop
            keep = ~hit_stop & (row_max[active] > step + 1)
            if keeping:
                self._keep_caches(requests, row_req, active, keep, cache, mask, out_tokens, step)
            if not bool(keep.any()):
                break
            if not bool(keep.all()):
                cache.batch_select_indices(keep.nonzero().squeeze(1))
                active, token, mask, positions = (
                    active[keep],
                    token[keep],
                    mask[keep],
                    positions[keep],
                )
            mask = torch.cat([mask, mask.new_ones((len(active), 1))], dim=1)
            positions = positions + 1
            version = self._policy_version
            if self.between_steps is not None:
                self.between_steps()
            if self._policy_version != version:  # new weights: recompute the cache under them
                if versions is None:
                    versions = torch.full(
                        (num_rows, max_new), version, dtype=torch.int32, device=dev
                    )
                cache, logits, mask = self._recompute(
                    requests, row_req, active, out_tokens, step + 1
                )
                positions = mask.sum(dim=1, keepdim=True) - 1
                continue
            logits = self._forward(token.unsqueeze(1), mask, positions, cache)
        return out_tokens, out_logprobs, lengths, stopped, versions

    def _recompute(
        self,
        requests: Sequence[GenerationRequest],
        row_req: torch.Tensor,
        active: torch.Tensor,
        out_tokens: torch.Tensor,
        done: int,
    ) -> tuple[DynamicCache, torch.Tensor, torch.Tensor]:
        """A fresh KV cache of the running rows' prompt + first `done` tokens under the weights
        loaded now, the logits of their next token and the attention mask (rows in order)."""
        start = time.perf_counter()
        rows = [
            GenerationRequest(
                prompt_tokens=[
                    *requests[int(row_req[r])].prompt_tokens,
                    *out_tokens[r, :done].tolist(),
                ],
            )  # fmt: skip
            for r in active.tolist()
        ]
        cache = DynamicCache(config=self.model.config)
        logits, mask = self._prefill(rows, cache)
        self.inflight_recompute_s += time.perf_counter() - start
        self.inflight_updates += 1
        return cache, logits, mask

    def _prefill_reusing(
        self, requests: Sequence[GenerationRequest]
    ) -> tuple[DynamicCache, torch.Tensor, torch.Tensor]:
        """`_prefill`, continuing kept caches where requests name usable ones: the cached
        tokens right-aligned, then each request's new tokens left-padded after them."""
        entries = [self.kv.take(r.resume_key, r.prompt_tokens, self._policy_version)
                   for r in requests]  # fmt: skip
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

    def _keep_caches(
        self,
        requests: Sequence[GenerationRequest],
        row_req: torch.Tensor,
        active: torch.Tensor,
        keep: torch.Tensor,
        cache: DynamicCache,
        mask: torch.Tensor,
        out_tokens: torch.Tensor,
        step: int,
    ) -> None:
        """Keep the caches of the rows that finish at this step (their last sampled token is
        not in the cache: the next request brings it with the new tokens)."""
        first_row = torch.cumsum(torch.tensor([0] + [r.n for r in requests[:-1]]), 0)
        for pos in (~keep).nonzero().squeeze(1).tolist():
            row = int(active[pos])
            req_index = int(row_req[row])
            request = requests[req_index]
            if not request.cache_keys:
                continue
            key = request.cache_keys[row - int(first_row[req_index])]
            tokens = [*request.prompt_tokens, *out_tokens[row, :step].tolist()]
            self.kv.save(key, row_entry(cache, pos, mask[pos], tokens, self._policy_version))

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

    def _noise(
        self, row_req: torch.Tensor, seeded: dict[int, torch.Generator], vocab: int
    ) -> torch.Tensor:
        """Exp(1) noise [rows, V]: per-request streams for seeded requests, the engine's else."""
        noise = torch.empty((len(row_req), vocab), device=self._device)
        noise.exponential_(generator=self._generator)
        for req_index, gen in seeded.items():
            rows = (row_req == req_index).nonzero().squeeze(1)
            noise[rows] = torch.empty((len(rows), vocab), device=self._device).exponential_(
                generator=gen
            )
        return noise

    def _to_samples(
        self,
        requests: Sequence[GenerationRequest],
        tokens: torch.Tensor,
        logprobs: torch.Tensor,
        lengths: torch.Tensor,
        stopped: torch.Tensor,
        versions: torch.Tensor | None = None,
    ) -> list[list[Sample]]:
        tokens_np = tokens.cpu().numpy().astype(np.int32)
        versions_np = None if versions is None else versions.cpu().numpy().astype(np.int32)
        logprobs_np = logprobs.cpu().numpy()
        lengths_np, stopped_np = lengths.cpu().numpy(), stopped.cpu().numpy()
        results: list[list[Sample]] = []
        row = 0
        for req in requests:
            group = []
            for _ in range(req.n):
                length = int(lengths_np[row])
                row_versions = None if versions_np is None else versions_np[row, :length].copy()
                group.append(
                    Sample(
                        completion_tokens=tokens_np[row, :length].copy(),
                        logprobs=logprobs_np[row, :length].copy(),
                        finish_reason="stop" if stopped_np[row] else "length",
                        policy_version=(
                            self._policy_version if row_versions is None else int(row_versions[0])
                        ),
                        versions=row_versions,
                    )
                )
                row += 1
            results.append(group)
        return results


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


def _stop_table(requests: Sequence[GenerationRequest], device: torch.device) -> torch.Tensor:
    """Stop ids per request [R, S], padded with -1 (never a token id)."""
    width = max(1, max(len(r.stop_token_ids) for r in requests))
    table = torch.full((len(requests), width), -1, dtype=torch.long)
    for i, req in enumerate(requests):
        table[i, : len(req.stop_token_ids)] = torch.tensor(req.stop_token_ids, dtype=torch.long)
    return table.to(device)


def _request_generator(req: GenerationRequest, device: torch.device) -> torch.Generator:
    return torch.Generator(device=device).manual_seed(int(req.seed))


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
