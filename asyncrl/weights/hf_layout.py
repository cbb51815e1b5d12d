"""A model's parameters under the names and shapes of its Hugging Face checkpoint.

What actors load (vLLM's weight loaders, a model directory's safetensors) is the checkpoint
layout; what a trainer holds is the module layout. The two differ for transformers 5's MoE
layers, which keep each layer's experts fused in two 3-D parameters

    mlp.experts.gate_up_proj  [E, 2I, H]   (gate rows first, then up)
    mlp.experts.down_proj     [E, H, I]

while checkpoints (and vLLM) name every expert's matrices, `mlp.experts.{e}.gate_proj.weight`
[I, H], `...up_proj.weight` [I, H], `...down_proj.weight` [H, I]. `checkpoint_tensors` yields
the checkpoint names with views into the fused parameters (no copy): the bucket plan, a
publication's snapshot and the torch engine's in-place loads all go through it, so learner and
actors agree on names, shapes and the plan's hash. Every other parameter passes unchanged.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch


def checkpoint_tensors(
    named: Iterable[tuple[str, torch.Tensor]],
) -> Iterator[tuple[str, torch.Tensor]]:
    """`named` (module layout) as (checkpoint name, view) pairs."""
    for name, tensor in named:
        prefix, _, leaf = name.rpartition(".")
        fused = prefix.endswith(".experts") and tensor.dim() == 3
        if fused and leaf == "gate_up_proj":
            half = tensor.shape[1] // 2
            for e in range(tensor.shape[0]):
                yield f"{prefix}.{e}.gate_proj.weight", tensor[e, :half]
                yield f"{prefix}.{e}.up_proj.weight", tensor[e, half:]
        elif fused and leaf == "down_proj":
            for e in range(tensor.shape[0]):
                yield f"{prefix}.{e}.down_proj.weight", tensor[e]
        else:
            yield name, tensor


def has_fused_experts(named: Iterable[tuple[str, torch.Tensor]]) -> bool:
    """True when some parameters are fused MoE experts (the two layouts differ)."""
    return any(n.rpartition(".")[0].endswith(".experts") and t.dim() == 3 for n, t in named)
