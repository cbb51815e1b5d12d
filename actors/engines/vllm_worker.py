"""The vLLM worker extension that swaps new weights into a running vLLM model in place.

vLLM mixes this class into its worker when the engine is built with
`worker_extension_cls="actors.engines.vllm_worker.WeightLoaderExtension"`; `VllmEngine` then
reaches `load_hf_weights` through `LLM.collective_rpc`. With vLLM's engine multiprocessing off
(what `VllmEngine` sets) the worker lives in the calling process, so the tensors are handed over
as they are: no copy, no serialisation.

Two paths, because vLLM's CPU and GPU models differ after startup:

- CPU: linear layers are prepacked for the CPU kernels once loaded, so the model's own
  `load_weights` no longer works (their parameters lose their `weight_loader`). The worker's
  `reload_weights(weights_iterator=..., is_checkpoint_format=True)` restores each layer to
  checkpoint layout, loads, re-runs the post-load processing (the prepacking) and copies the
  result back into the original storage.
- GPU: parameters keep their loaders, so the model's `load_weights` copies the tensors
  straight into place (the usual path of RL frameworks on vLLM).

Both take Hugging Face names (`model.layers.0.self_attn.q_proj.weight`) and fuse q/k/v and
gate/up themselves. On CPU a fused layer is rebuilt from the parts that arrive in one call: a
part left out is not kept from before but comes back as uninitialised memory. So every part of a
fused layer must come in the same call; `fused_parameter_groups` tells the caller which parts
belong together (`VllmEngine` checks this before sending).

The caller resets vLLM's prefix cache afterwards: cached KV blocks were computed by the old
weights and would otherwise be reused by later prompts that share a prefix.
"""

from __future__ import annotations

from typing import Any

import torch


class WeightLoaderExtension:
    """Methods vLLM adds to its worker (`self` is then the worker).

    vLLM refuses an extension that names anything its worker already has, so this class only
    adds its own methods and reaches the worker's members through `self`.
    """

    def load_hf_weights(self, named_tensors: list[tuple[str, torch.Tensor]]) -> int:
        """Load these Hugging Face-named tensors into the model in place; return how many."""
        from vllm.platforms import current_platform

        worker: Any = self
        if current_platform.is_cpu():
            # The worker's `reload_weights` sets vLLM's current config around the model
            # runner's reload, which the layers' post-load processing reads.
            worker.reload_weights(weights_iterator=named_tensors, is_checkpoint_format=True)
        else:
            worker.model_runner.model.load_weights(weights=named_tensors)
        return len(named_tensors)

    def fused_parameter_groups(self) -> dict[str, list[str]]:
        """vLLM's fused module -> the Hugging Face modules it packs (e.g. qkv_proj -> q, k, v)."""
        worker: Any = self
        packed = getattr(worker.model_runner.get_model(), "packed_modules_mapping", {})
        return {fused: list(parts) for fused, parts in packed.items()}
