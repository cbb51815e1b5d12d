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

A head tied to the input embeddings shares their weight, but on CPU its GEMM runs on a packed
copy: after new embeddings arrive, that copy is packed again.

The caller resets vLLM's prefix cache afterwards: cached KV blocks were computed by the old
weights and would otherwise be reused by later prompts that share a prefix.

`hf_named_weights` reads back what the model computes with, under Hugging Face names, so it can
be compared with a trainer's tensors bit for bit: fused layers are split (qkv_proj into
q/k/v_proj by the config's head counts and head size, gate_up_proj into gate/up_proj by the
intermediate size) and vocabulary padding is cut off. On CPU a linear layer keeps no weight
tensor after startup or a reload (its weight lives only inside the packed operand of vLLM's CPU
GEMM, and the parameter is left empty), so its weight is read through that GEMM itself: the
layer applied to identity rows yields the rows of Wᵀ, exactly (each output element is one
weight times 1.0 plus zeros; a weight of -0.0 reads back as +0.0, which `torch.equal` accepts).
Tensor parallelism is not supported there (each worker would hold a shard).
"""

from __future__ import annotations

from typing import Any

import torch

PROBE_ROWS = 1024
"""Identity rows per GEMM call when reading a packed CPU weight back (bounds the memory)."""


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
            if any(name.endswith("embed_tokens.weight") for name, _ in named_tensors):
                _repack_tied_head(worker.model_runner.get_model())
        else:
            worker.model_runner.model.load_weights(weights=named_tensors)
        return len(named_tensors)

    def fused_parameter_groups(self) -> dict[str, list[str]]:
        """vLLM's fused module -> the Hugging Face modules it packs (e.g. qkv_proj -> q, k, v)."""
        worker: Any = self
        packed = getattr(worker.model_runner.get_model(), "packed_modules_mapping", {})
        return {fused: list(parts) for fused, parts in packed.items()}

    def hf_named_weights(self) -> list[tuple[str, torch.Tensor]]:
        """The model's live weights as (Hugging Face name, CPU copy), fused layers split."""
        worker: Any = self
        if worker.parallel_config.tensor_parallel_size != 1:
            raise ValueError("named_weights: needs tensor_parallel_size 1 (workers hold shards)")
        model = worker.model_runner.get_model()
        config = worker.model_config.hf_text_config
        packed = getattr(model, "packed_modules_mapping", {})
        out: list[tuple[str, torch.Tensor]] = []
        with torch.no_grad():
            for name, param in model.named_parameters():
                module_name, _, leaf = name.rpartition(".")
                module = model.get_submodule(module_name)
                tensor = _unpadded(module, _live_tensor(module, leaf, param))
                parent, _, short = module_name.rpartition(".")
                if short not in packed:
                    out.append((name, tensor.to("cpu", copy=True)))
                    continue
                sizes = _part_sizes(short, module, config, tensor.shape[0])
                for part, piece in zip(packed[short], tensor.split(sizes), strict=True):
                    out.append((f"{parent}.{part}.{leaf}", piece.to("cpu", copy=True)))
        return out


def _repack_tied_head(model: Any) -> None:
    """A head tied to the input embeddings (Qwen2, Qwen3, Gemma...) shares its weight, but on
    CPU its GEMM runs on a packed copy made at startup, which a reload of the embeddings leaves
    stale: pack it again from the (new) shared weight."""
    head = getattr(model, "lm_head", None)
    inner = getattr(model, "model", None)
    embed = getattr(inner, "embed_tokens", None)
    if head is None or embed is None or head.weight is not embed.weight:
        return
    head.quant_method.process_weights_after_loading(head)


def _live_tensor(module: Any, leaf: str, param: torch.Tensor) -> torch.Tensor:
    """The parameter, or for a CPU-packed linear layer (empty weight) its weight read back."""
    if param.numel() > 0 or leaf != "weight":
        return param.detach()
    num_in = int(module.input_size_per_partition)
    rows = []
    for start in range(0, num_in, PROBE_ROWS):
        count = min(PROBE_ROWS, num_in - start)
        eye = torch.zeros((count, num_in), dtype=param.dtype)
        eye[torch.arange(count), torch.arange(start, start + count)] = 1
        rows.append(module.quant_method.apply(module, eye, None))  # = rows start.. of W^T
    weight_t = torch.cat(rows)
    assert weight_t.dtype == param.dtype, (weight_t.dtype, param.dtype)
    return weight_t.t().contiguous()


def _unpadded(module: Any, tensor: torch.Tensor) -> torch.Tensor:
    """Vocabulary-parallel embeddings and heads pad the vocabulary: keep the real rows."""
    padded = getattr(module, "num_embeddings_padded", None)
    if padded is None or tensor.shape[0] != padded:
        return tensor
    assert getattr(module, "num_added_embeddings", 0) == 0, "added vocabulary is not supported"
    return tensor[: module.num_embeddings]


def _part_sizes(fused: str, module: Any, config: Any, total: int) -> list[int]:
    """Rows of each part of a fused layer: from the model config, else from the layer."""
    sizes: list[int] = []
    if fused == "qkv_proj":
        heads = config.num_attention_heads
        kv_heads = getattr(config, "num_key_value_heads", None) or heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
        sizes = [heads * head_dim, kv_heads * head_dim, kv_heads * head_dim]
    elif fused == "gate_up_proj":
        sizes = [config.intermediate_size] * 2
    if sum(sizes) != total:  # another fusion, or a layer the config does not describe
        sizes = [int(n) for n in getattr(module, "output_sizes", ())]
    assert sum(sizes) == total, f"{fused}: parts {sizes} do not add up to {total} rows"
    return sizes
