"""The policy a learner trains: the model loaded from the run's model directory in its dtype,
on this rank's device and, with several ranks, sharded (FSDP2); its AdamW optimizer; the bucket
plan its weights are published with (made from the full parameters, before sharding)."""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from asyncrl.config import RunConfig
from asyncrl.weights.bucket_plan import BucketPlan, params_from_module
from asyncrl.weights.hf_layout import has_fused_experts
from learner.parallel import Ranks, shard_model


def load_policy(
    cfg: RunConfig, model_dir: Path, ranks: Ranks
) -> tuple[torch.nn.Module, BucketPlan, int]:
    """(model in train mode on this rank's device, sharded when there are several ranks; the
    weights' bucket plan; the tokenizer's pad id)."""
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=_dtype(cfg.model.dtype))
    model.train()
    plan = BucketPlan.from_params(params_from_module(model), cfg.weights.bucket_bytes)
    model.to(train_device(cfg.learner.device, ranks.local_rank))
    if ranks.distributed:
        if has_fused_experts(model.named_parameters()):
            raise ValueError(
                "learner.world > 1: models with fused MoE expert parameters cannot be "
                "published from shards yet; train this model with learner.world = 1"
            )
        shard_model(model, ranks)
    return model, plan, int(AutoTokenizer.from_pretrained(model_dir).pad_token_id)


def make_adamw(model: torch.nn.Module, lr: float, weight_decay: float) -> torch.optim.AdamW:
    """AdamW, fused into one kernel per step where torch has one for these parameters (CPU and
    CUDA floating point): a tiny model's step is otherwise dominated by per-tensor dispatch."""
    params = list(model.parameters())
    fusable = all(p.is_floating_point() and p.device.type in ("cpu", "cuda") for p in params)
    return torch.optim.AdamW(
        params, lr=lr, weight_decay=weight_decay, **({"fused": True} if fusable else {})
    )


def train_device(choice: str, local_rank: int) -> torch.device:
    """Where the learner trains: `learner.device` ("auto": this rank's GPU when there is one)."""
    if choice == "cuda" and not torch.cuda.is_available():
        raise ValueError("learner.device: 'cuda' asked for, but torch sees no CUDA device")
    if choice == "cpu" or not torch.cuda.is_available():
        return torch.device("cpu")
    return torch.device("cuda", local_rank)


def _dtype(name: str) -> torch.dtype:
    return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[name]
