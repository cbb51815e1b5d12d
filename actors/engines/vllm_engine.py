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

Weight updates go through the worker extension and are followed by `reset_prefix_cache()`:
KV blocks cached under the old weights would otherwise be reused for prompts sharing a prefix,
and the next samples would silently mix two policies.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterable, Sequence
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
    """Generation with vLLM; weights swapped in place by the worker extension."""

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
        if not Path(model_dir).is_dir():
            raise ValueError(f"model_dir: directory not found: {str(model_dir)!r}")
        if block_size is not None and block_size < 1:
            raise ValueError(f"block_size: must be >= 1, got {block_size}")
        if kv_cache_gib <= 0:
            raise ValueError(f"kv_cache_gib: must be > 0, got {kv_cache_gib}")
        if not 0 < gpu_memory_utilization <= 1:
            raise ValueError(
                f"gpu_memory_utilization: must be in (0, 1], got {gpu_memory_utilization}"
            )
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        from vllm import LLM
        from vllm.platforms import current_platform

        options: dict[str, Any] = {"gpu_memory_utilization": gpu_memory_utilization}
        if current_platform.is_cpu():
            options = {"kv_cache_memory_bytes": int(kv_cache_gib * 2**30)}
        if block_size is not None:
            options["block_size"] = block_size
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
        self._policy_version = 0

    @property
    def policy_version(self) -> int:
        """Policy version of the weights currently loaded (0 = the model directory's)."""
        return self._policy_version

    def generate(self, requests: Sequence[GenerationRequest]) -> list[list[Sample]]:
        """Sample `request.n` completions per request in one vLLM batch."""
        if not requests:
            return []
        prompts: list[Any] = [{"prompt_token_ids": self._prompt(r)} for r in requests]
        params = [self._sampling_params(r) for r in requests]
        outputs = self._llm.generate(prompts, params, use_tqdm=False)
        assert len(outputs) == len(requests)
        return [[self._sample(c) for c in out.outputs] for out in outputs]

    def load_weights(
        self, named_tensors: Iterable[tuple[str, torch.Tensor]], policy_version: int
    ) -> None:
        """Copy these Hugging Face-named tensors into vLLM's model; then hold `policy_version`.

        All tensors of one update must come in this one call (fused layers such as q/k/v are
        processed once all their parts have arrived).
        """
        tensors = [(name, tensor.detach()) for name, tensor in named_tensors]
        if not tensors:
            raise ValueError("load_weights: no tensors given")
        (count,) = self._llm.collective_rpc("load_hf_weights", args=(tensors,))
        assert count == len(tensors)
        # Cached KV blocks were computed by the old weights: drop them.
        assert self._llm.reset_prefix_cache(), "prefix cache not reset (requests still running)"
        self._policy_version = policy_version

    def close(self) -> None:
        """Shut vLLM's engine down; the engine is unusable afterwards."""
        llm = getattr(self, "_llm", None)
        if llm is None:
            return
        llm.llm_engine.engine_core.shutdown()
        del self._llm

    def _prompt(self, request: GenerationRequest) -> list[int]:
        prompt = [int(t) for t in request.prompt_tokens]
        if not prompt:
            raise ValueError("prompt_tokens: must not be empty")
        if len(prompt) + request.max_new_tokens > self.max_model_len:
            raise ValueError(
                f"prompt_tokens: {len(prompt)} prompt + {request.max_new_tokens} new tokens "
                f"exceed the model's max_model_len={self.max_model_len}"
            )
        return prompt

    def _sampling_params(self, request: GenerationRequest) -> Any:
        from vllm import SamplingParams

        if request.n < 1:
            raise ValueError(f"n: must be >= 1, got {request.n}")
        if not 0 < request.temperature <= MAX_TEMPERATURE:
            raise ValueError(
                f"temperature: vLLM needs it in (0, {MAX_TEMPERATURE}], got {request.temperature}"
            )
        if not 0 < request.top_p <= 1:
            raise ValueError(f"top_p: must be in (0, 1], got {request.top_p}")
        if request.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens: must be >= 1, got {request.max_new_tokens}")
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
