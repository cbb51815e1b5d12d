"""The vLLM generation engine: the `Engine` protocol on top of `vllm.LLM`.

One `generate` call hands every request to a single `LLM.generate`, so vLLM batches all prompts
and samples together. What it relies on in vLLM, and why:

- `logprobs_mode="processed_logprobs"` with `SamplingParams(logprobs=0)`: each sampled token's
  log-probability under the distribution it was drawn from, i.e. log_softmax of the logits
  divided by the temperature, renormalised over the top-p nucleus. vLLM's default
  (`raw_logprobs`) would report the temperature-1, untruncated distribution instead, which is not
  the behaviour policy μ that importance corrections need.
- `ignore_eos=True` and `generation_config="vllm"`: only the request's `stop_token_ids` end a
  sample, as in the torch engine; the model directory's eos and generation defaults do not.
- `VLLM_ENABLE_V1_MULTIPROCESSING=0` (set in this process's environment): the engine core and
  its worker run in the calling process, so `load_weights` hands tensors to the worker as they
  are (see `vllm_worker.py`). On a GPU the same holds.
- `enforce_eager=True`: no compilation or graph capture, which keeps startup at a few seconds.
- KV cache size: on CPU `kv_cache_gib` (vLLM would otherwise reserve most of host memory; an
  explicit `VLLM_CPU_KVCACHE_SPACE` in the environment still wins, as vLLM reads it last); on a
  GPU `gpu_memory_utilization` decides.
- Temperature: vLLM accepts (0, 2] and samples below 0.01 at 0.01; the logprobs are those of
  the temperature it actually used.

Running in-process has process-wide effects on CPU: vLLM's CPU worker replaces
`torch.set_num_threads` with a no-op that logs a warning (so later calls in this process,
including vLLM's own around each `generate`, change nothing), and it sets a NUMA memory-binding
policy. An actor process that runs vLLM should leave the thread count to it.

In-flight weight updates (`between_steps` set): `generate` drives vLLM's engine step by step
(`LLMEngine.add_request` / `step`) instead of `LLM.generate`, one request per sample (a
seeded request's i-th sample uses seed + i), and calls `between_steps` after every engine step.
When that loaded new weights, the unfinished requests are aborted and re-submitted as prompt +
tokens so far (the remaining token budget, a seed derived from the update count): vLLM
recomputes their KV cache under the new weights, so every later token is sampled from exactly
the new version and its logprob is that version's; each token records its version.

Weight updates go through the worker extension and are followed by `reset_prefix_cache()`:
KV blocks cached under the old weights would otherwise be reused for prompts sharing a prefix,
and the next samples would silently mix two policies.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any, Literal

import numpy as np
import torch

from actors.engines.base import GenerationRequest, Sample

WORKER_EXTENSION = "actors.engines.vllm_worker.WeightLoaderExtension"
"""Qualified name of the worker extension vLLM mixes into its worker."""
MAX_TEMPERATURE = 2.0
"""vLLM refuses higher sampling temperatures."""


class VllmEngine:
    """Generation with vLLM; weights swapped in place by the worker extension.

    `model_dir` is a Hugging Face model directory (the tiny model or a real one). `dtype` is the
    dtype vLLM computes in; `seed` seeds requests that carry no seed of their own.
    `kv_cache_gib` sizes the KV cache on CPU, `gpu_memory_utilization` the share of GPU memory
    vLLM takes on a GPU. `block_size` is the KV block size in tokens (None = vLLM's default,
    128 on CPU): the prefix cache only keeps whole blocks, so short prompts need small blocks to
    be cached at all.
    """

    def __init__(
        self,
        model_dir: Path,
        *,
        dtype: Literal["float32", "bfloat16", "float16"] = "float32",
        seed: int = 0,
        kv_cache_gib: float = 1.0,
        gpu_memory_utilization: float = 0.5,
        enable_prefix_caching: bool = True,
        block_size: int | None = None,
    ) -> None:
        model_dir = Path(model_dir)
        if not model_dir.is_dir():
            raise ValueError(f"model_dir: directory not found: {str(model_dir)!r}")
        options = _memory_options(kv_cache_gib, gpu_memory_utilization, block_size)
        from vllm import LLM

        start = time.perf_counter()
        self._llm = LLM(
            model=str(model_dir),
            dtype=dtype,
            seed=seed,
            enforce_eager=True,
            enable_prefix_caching=enable_prefix_caching,
            logprobs_mode="processed_logprobs",
            generation_config="vllm",
            worker_extension_cls=WORKER_EXTENSION,
            **options,
        )
        self.startup_s = time.perf_counter() - start
        """Seconds `vllm.LLM` took to start (the `import vllm` before it not included)."""
        self.max_model_len: int = self._llm.llm_engine.model_config.max_model_len
        """Longest prompt + completion vLLM accepts, in tokens."""
        self._shapes = checkpoint_shapes(model_dir)
        (self._fused,) = self._llm.collective_rpc("fused_parameter_groups")
        self._policy_version = 0
        self._stepping = False  # inside an in-flight generate: requests are running
        self.between_steps: Callable[[], None] | None = None
        """Called between engine steps (in-flight weight updates; see the module doc)."""
        self.inflight_updates = 0
        """Weight updates applied while sequences were in flight."""
        self.inflight_recompute_s = 0.0
        """Seconds spent aborting and re-submitting requests after in-flight updates."""
        from vllm.platforms import current_platform

        self._cpu = current_platform.is_cpu()

    @property
    def policy_version(self) -> int:
        """Policy version of the weights currently loaded (0 = the model directory's)."""
        return self._policy_version

    def generate(self, requests: Sequence[GenerationRequest]) -> list[list[Sample]]:
        """Sample `request.n` completions per request in one vLLM batch."""
        if not requests:
            return []
        prompts: list[Any] = [
            {"prompt_token_ids": self._prompt(i, r)} for i, r in enumerate(requests)
        ]
        params = [self._sampling_params(i, r) for i, r in enumerate(requests)]
        if self.between_steps is not None:
            return self._generate_stepwise(prompts, params)
        outputs = self._llm.generate(prompts, params, use_tqdm=False)
        assert len(outputs) == len(requests)
        return [[self._sample(c) for c in out.outputs] for out in outputs]

    def load_weights(
        self, named_tensors: Iterable[tuple[str, torch.Tensor]], policy_version: int
    ) -> None:
        """Copy these Hugging Face-named tensors into vLLM's model; then hold `policy_version`.

        Any subset of the model's tensors may be sent, except that the parts of a fused layer
        (q/k/v, gate/up) must come together. All are checked before any is copied.
        """
        tensors = [(name, tensor.detach()) for name, tensor in named_tensors]
        if not tensors:
            raise ValueError("load_weights: no tensors given")
        if self._cpu and any(".mlp.experts." in name for name, _ in tensors):
            raise ValueError(
                "load_weights: vLLM on CPU cannot reload MoE expert weights in place (its "
                "packed CPU MoE layers come back wrong); use the torch engine for MoE on CPU"
            )
        for name, tensor in tensors:
            self._check_tensor(name, tensor)
        self._check_fused_parts_together({name for name, _ in tensors})
        (count,) = self._llm.collective_rpc("load_hf_weights", args=(tensors,))
        assert count == len(tensors)
        # Cached KV blocks were computed by the old weights: drop them (an in-flight generate
        # does so once its running requests are aborted).
        if not self._stepping:
            assert self._llm.reset_prefix_cache(), "prefix cache not reset (requests running)"
        self._policy_version = policy_version

    def _generate_stepwise(self, prompts: list[Any], params: list[Any]) -> list[list[Sample]]:
        """`generate` with `between_steps` called after every engine step (module doc)."""
        rows = [
            _Row(prompt=p["prompt_token_ids"], params=_single(sp, i), index=r)
            for r, (p, sp) in enumerate(zip(prompts, params, strict=True))
            for i in range(sp.n)
        ]
        engine = self._llm.llm_engine
        self._stepping = True
        try:
            self._submit(rows, generation=0)
            while engine.has_unfinished_requests():
                for out in engine.step():
                    rows[int(out.request_id.split("-")[0])].update(out, self._policy_version)
                version = self._policy_version
                self.between_steps()  # type: ignore[misc]
                if self._policy_version == version:
                    continue
                if engine.has_unfinished_requests():
                    self._resubmit(rows)
                else:  # loaded after the last step: only the prefix cache is stale
                    assert self._llm.reset_prefix_cache(), "prefix cache not reset"
        finally:
            self._stepping = False
        results: list[list[Sample]] = [[] for _ in prompts]
        for row in rows:
            results[row.index].append(row.sample())
        return results

    def _submit(self, rows: Sequence[_Row], generation: int) -> None:
        for i, row in enumerate(rows):
            if row.finished:
                continue
            params = row.params.clone()
            params.max_tokens = row.params.max_tokens - len(row.tokens)
            if params.seed is not None and generation:
                params.seed = (params.seed * 1_000_003 + generation) & 0x7FFFFFFF
            prompt = {"prompt_token_ids": [*row.prompt, *row.tokens]}
            row.request_id = f"{i}-{generation}"
            self._llm.llm_engine.add_request(row.request_id, prompt, params)
            row.base = len(row.tokens)

    def _resubmit(self, rows: Sequence[_Row]) -> None:
        """New weights mid-generation: abort the running requests and submit them again as
        prompt + tokens so far, so vLLM recomputes their KV cache under the new weights."""
        start = time.perf_counter()
        self.inflight_updates += 1
        self._llm.llm_engine.abort_request([r.request_id for r in rows if not r.finished])
        assert self._llm.reset_prefix_cache(), "prefix cache not reset after aborting requests"
        self._submit(rows, generation=self.inflight_updates)
        self.inflight_recompute_s += time.perf_counter() - start

    def named_weights(self) -> list[tuple[str, torch.Tensor]]:
        """The weights vLLM's model computes with now, under Hugging Face names, as CPU copies.

        Read from the live model by the worker extension (fused layers split, vocabulary
        padding removed), so they compare bit for bit with the tensors a trainer sent.
        """
        (named,) = self._llm.collective_rpc("hf_named_weights")
        return list(named)

    def close(self) -> None:
        """Shut vLLM's engine down; the engine is unusable afterwards."""
        llm = getattr(self, "_llm", None)
        if llm is None:
            return
        llm.llm_engine.engine_core.shutdown()
        del self._llm

    def _check_tensor(self, name: str, tensor: torch.Tensor) -> None:
        if not self._shapes:  # no safetensors checkpoint to check against
            return
        if name not in self._shapes:
            raise ValueError(f"load_weights: unknown tensor {name!r}")
        if tuple(tensor.shape) != self._shapes[name]:
            raise ValueError(
                f"load_weights: {name!r} has shape {tuple(tensor.shape)}, "
                f"expected {self._shapes[name]}"
            )

    def _check_fused_parts_together(self, names: set[str]) -> None:
        for name in names:
            parent, _, rest = name.rpartition(".")  # "...self_attn.q_proj", "weight"
            path, _, module = parent.rpartition(".")
            for parts in self._fused.values():
                if module not in parts:
                    continue
                siblings = {f"{path}.{part}.{rest}" for part in parts}
                if self._shapes:
                    siblings &= self._shapes.keys()
                if missing := sorted(siblings - names):
                    raise ValueError(
                        f"load_weights: {name!r} is fused with {missing} in vLLM; "
                        "send the parts of a fused layer together"
                    )

    def _prompt(self, index: int, request: GenerationRequest) -> list[int]:
        prompt = [int(t) for t in request.prompt_tokens]
        if not prompt:
            raise ValueError(f"requests[{index}].prompt_tokens: must not be empty")
        if len(prompt) + request.max_new_tokens > self.max_model_len:
            raise ValueError(
                f"requests[{index}].prompt_tokens: {len(prompt)} prompt + "
                f"{request.max_new_tokens} new tokens exceed max_model_len={self.max_model_len}"
            )
        return prompt

    def _sampling_params(self, index: int, request: GenerationRequest) -> Any:
        from vllm import SamplingParams

        where = f"requests[{index}]"
        if request.n < 1:
            raise ValueError(f"{where}.n: must be >= 1, got {request.n}")
        if not 0 < request.temperature <= MAX_TEMPERATURE:
            raise ValueError(
                f"{where}.temperature: vLLM needs (0, {MAX_TEMPERATURE}], got {request.temperature}"
            )
        if not 0 < request.top_p <= 1:
            raise ValueError(f"{where}.top_p: must be in (0, 1], got {request.top_p}")
        if request.max_new_tokens < 1:
            raise ValueError(f"{where}.max_new_tokens: must be >= 1, got {request.max_new_tokens}")
        return SamplingParams(
            n=request.n,
            temperature=request.temperature,
            top_p=request.top_p,
            max_tokens=request.max_new_tokens,
            stop_token_ids=list(request.stop_token_ids),
            ignore_eos=True,
            seed=request.seed,
            logprobs=0,
            detokenize=False,
        )

    def _sample(self, completion: Any) -> Sample:
        tokens = np.asarray(completion.token_ids, dtype=np.int32)
        assert completion.logprobs is not None and len(completion.logprobs) == len(tokens)
        logprobs = np.array(
            [step[int(t)].logprob for step, t in zip(completion.logprobs, tokens, strict=True)],
            dtype=np.float32,
        )
        reason = completion.finish_reason
        assert reason in ("stop", "length"), f"unexpected vLLM finish_reason {reason!r}"
        return Sample(
            completion_tokens=tokens,
            logprobs=logprobs,
            finish_reason=reason,
            policy_version=self._policy_version,
        )


def checkpoint_shapes(model_dir: Path) -> dict[str, tuple[int, ...]]:
    """Name -> shape of every tensor in the directory's safetensors files (headers only)."""
    from safetensors import safe_open

    shapes: dict[str, tuple[int, ...]] = {}
    for path in sorted(model_dir.glob("*.safetensors")):
        with safe_open(path, framework="pt") as checkpoint:
            for name in checkpoint.keys():
                shapes[name] = tuple(checkpoint.get_slice(name).get_shape())
    # Tied embeddings: checkpoints omit the head, a trainer may still send it.
    if "lm_head.weight" not in shapes and "model.embed_tokens.weight" in shapes:
        shapes["lm_head.weight"] = shapes["model.embed_tokens.weight"]
    return shapes


def _memory_options(
    kv_cache_gib: float, gpu_memory_utilization: float, block_size: int | None
) -> dict[str, Any]:
    """`vllm.LLM` keyword arguments for the KV cache; sets the in-process engine switch."""
    if kv_cache_gib <= 0:
        raise ValueError(f"kv_cache_gib: must be > 0, got {kv_cache_gib}")
    if not 0 < gpu_memory_utilization <= 1:
        raise ValueError(f"gpu_memory_utilization: must be in (0, 1], got {gpu_memory_utilization}")
    if block_size is not None and block_size < 1:
        raise ValueError(f"block_size: must be >= 1, got {block_size}")
    # Read when the engine starts: keeps the engine core and its worker in this process.
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    from vllm.platforms import current_platform

    options: dict[str, Any] = {"gpu_memory_utilization": gpu_memory_utilization}
    if current_platform.is_cpu():
        options = {"kv_cache_memory_bytes": int(kv_cache_gib * 2**30)}
    if block_size is not None:
        options["block_size"] = block_size
    return options


class _Row:
    """One sample of an in-flight `generate`: what it generated so far, token by token."""

    def __init__(self, prompt: list[int], params: Any, index: int) -> None:
        self.prompt, self.params, self.index = prompt, params, index
        self.tokens: list[int] = []
        self.logprobs: list[float] = []
        self.versions: list[int] = []
        self.base = 0  # tokens generated before the current submission
        self.request_id = ""  # of the current submission
        self.finished = False
        self.reason = "length"

    def update(self, out: Any, version: int) -> None:
        """A cumulative output of the current submission: append its new tokens."""
        completion = out.outputs[0]
        new = completion.token_ids[len(self.tokens) - self.base :]
        steps = completion.logprobs[len(self.tokens) - self.base :]
        for token, step in zip(new, steps, strict=True):
            self.tokens.append(int(token))
            self.logprobs.append(step[int(token)].logprob)
            self.versions.append(version)
        if out.finished:
            self.finished = True
            self.reason = completion.finish_reason
            assert self.reason in ("stop", "length"), f"unexpected finish_reason {self.reason!r}"

    def sample(self) -> Sample:
        versions = np.asarray(self.versions, dtype=np.int32)
        return Sample(
            completion_tokens=np.asarray(self.tokens, dtype=np.int32),
            logprobs=np.asarray(self.logprobs, dtype=np.float32),
            finish_reason="stop" if self.reason == "stop" else "length",
            policy_version=int(versions[0]) if len(versions) else 0,
            versions=versions if len(set(self.versions)) > 1 else None,
        )


def _single(params: Any, i: int) -> Any:
    """`params` for one sample (n = 1): the i-th of a seeded request gets seed + i."""
    one = params.clone()
    one.n = 1
    if one.seed is not None:
        one.seed = one.seed + i
    return one
