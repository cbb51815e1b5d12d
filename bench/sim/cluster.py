"""Cluster-scale assumptions, stated in one place, and the time models they imply.

Every number a prediction rests on is a field of `ClusterAssumptions` (with units and where it
comes from); everything else is derived in properties and written next to the prediction. The
derivations are first-order rooflines, not measurements:

- training: FLOPs per token = 6 · params (forward + backward), at `train_mfu` of the bf16 peak;
- decode: each step reads all weights once (`step_s`) and, per running sequence, its KV cache
  at the mean context plus 2 · params FLOPs (`token_s`); prefill is shared by a group's samples
  (prefix caching), so it costs 2 · params FLOPs per prompt token once per group;
- gradient reduction (exposed, at the end of accumulation): hierarchical, NVLink inside a node
  then InfiniBand across nodes, reduce-scatter + all-gather volume (2 · bytes);
- weight publication: the learner gathers full bf16 buckets (hierarchical, blocking: the
  snapshot), then broadcasts them pipelined over InfiniBand to every actor (a pipelined
  broadcast costs about bytes / link bandwidth regardless of the number of receivers), paying
  `bucket_latency_s` per bucket of the real `BucketPlan` of the model's parameter list;
- in-flight update (the pause of a generating actor): the engine copies the received weights
  into its own (2 · bytes over HBM) and recomputes the KV cache of its sequences in flight, a
  prefill of each group's prompt once and of every sequence's tokens so far (half its mean
  length, on average), times `inflight_recompute`.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from asyncrl.weights.bucket_plan import BucketPlan, ParamSpec

from .timing import GenerationTime, LearnerTime, LengthModel, WeightSync


@dataclass(frozen=True, kw_only=True)
class ClusterAssumptions:
    """The stated assumptions of a cluster-scale prediction (defaults: Llama-3.1-8B on H200)."""

    # model: Llama-3.1-8B shapes, bf16 (8.03e9 parameters, 16.06 GB)
    vocab_size: int = 128256
    """Vocabulary size (embedding and untied LM head)."""
    hidden_size: int = 4096
    """Model width."""
    num_layers: int = 32
    """Decoder layers."""
    num_heads: int = 32
    """Attention heads (head_dim = hidden_size / num_heads = 128)."""
    num_kv_heads: int = 8
    """Key/value heads (grouped-query attention): sets the KV cache bytes per token."""
    intermediate_size: int = 14336
    """MLP width."""
    dtype_bytes: int = 2
    """bf16 parameters, gradients for reduction, KV cache and broadcast buffers."""
    # H200 SXM figures (vendor datasheet), and achieved fractions (assumptions)
    gpu_bf16_flops: float = 989e12
    """Dense bf16 peak FLOP/s of one H200."""
    gpu_hbm_bytes_per_s: float = 4.8e12
    """HBM3e bandwidth of one H200."""
    train_mfu: float = 0.40
    """Achieved fraction of bf16 peak in training (forward + backward)."""
    decode_hbm_efficiency: float = 0.70
    """Achieved fraction of HBM bandwidth while decoding (vLLM, CUDA graphs)."""
    decode_mfu: float = 0.50
    """Achieved fraction of bf16 peak for the per-token matmuls of a large decode batch."""
    prefill_mfu: float = 0.50
    """Achieved fraction of bf16 peak in prefill."""
    nvlink_bytes_per_s: float = 900e9
    """NVLink bandwidth per GPU inside a node."""
    ib_bytes_per_s: float = 50e9
    """InfiniBand NDR 400 Gb/s per GPU across nodes (one NIC per GPU)."""
    gpus_per_node: int = 8
    """GPUs per node."""
    # system shape
    world: int = 512
    """Learner GPUs L (data parallel, FSDP)."""
    num_actors: int = 2048
    """Rollout actors A, one H200 each running vLLM with the whole model (TP = 1)."""
    concurrency: int = 8
    """Groups one actor generates together (8 x 16 = 128 sequences per vLLM batch)."""
    credit_window: int = 0
    """Credits an actor asks the hub for; 0 = 2 x concurrency, asyncrl's actor default."""
    group_size: int = 16
    """Samples per prompt."""
    groups_per_step: int = 1024
    """Prompts per optimizer step (16384 samples)."""
    # workload
    prompt_tokens: int = 512
    """Prompt length in tokens."""
    median_response_tokens: float = 1024.0
    """Median completion length (lognormal)."""
    response_sigma: float = 0.8
    """Lognormal shape of completion lengths: a long tail (p99 about 6.4x the median)."""
    max_response_tokens: int = 8192
    """Generation limit; the tail is truncated here."""
    # overheads and latencies (assumptions)
    gen_fixed_s: float = 0.2
    """Per generation batch: scheduling, detokenising, reward scoring, pushing the groups."""
    learner_overhead_s: float = 0.3
    """Per optimizer step: sharded AdamW update, collation, data loading, launch latencies."""
    bucket_bytes: int = 1 << 30
    """Weight broadcast bucket size (weights.bucket_bytes): 1 GiB."""
    bucket_latency_s: float = 5e-3
    """Per bucket: announce, collective launch, pipeline fill across the broadcast tree."""
    inflight_recompute: float = 1.0
    """Share of the in-flight context whose KV cache an in-flight update recomputes: 1 =
    asyncrl's engines (every later token from exactly one version), 0 = a kept cache."""

    # --- derived --------------------------------------------------------------------------------

    def param_specs(self) -> list[ParamSpec]:
        """(name, shape, dtype) of every parameter, Llama layout."""
        h, kv = self.hidden_size, self.num_kv_heads * (self.hidden_size // self.num_heads)
        specs: list[ParamSpec] = [("model.embed_tokens.weight", (self.vocab_size, h), "bfloat16")]
        for i in range(self.num_layers):
            p = f"model.layers.{i}."
            specs += [
                (p + "self_attn.q_proj.weight", (h, h), "bfloat16"),
                (p + "self_attn.k_proj.weight", (kv, h), "bfloat16"),
                (p + "self_attn.v_proj.weight", (kv, h), "bfloat16"),
                (p + "self_attn.o_proj.weight", (h, h), "bfloat16"),
                (p + "mlp.gate_proj.weight", (self.intermediate_size, h), "bfloat16"),
                (p + "mlp.up_proj.weight", (self.intermediate_size, h), "bfloat16"),
                (p + "mlp.down_proj.weight", (h, self.intermediate_size), "bfloat16"),
                (p + "input_layernorm.weight", (h,), "bfloat16"),
                (p + "post_attention_layernorm.weight", (h,), "bfloat16"),
            ]
        specs.append(("model.norm.weight", (h,), "bfloat16"))
        specs.append(("lm_head.weight", (self.vocab_size, h), "bfloat16"))
        return specs

    def bucket_plan(self) -> BucketPlan:
        return BucketPlan.from_params(self.param_specs(), self.bucket_bytes)

    def lengths(self) -> LengthModel:
        return LengthModel(
            median_tokens=self.median_response_tokens,
            sigma=self.response_sigma,
            max_tokens=self.max_response_tokens,
            prompt_tokens=self.prompt_tokens,
        )

    def generation(self, num_params: int) -> GenerationTime:
        param_bytes = num_params * self.dtype_bytes
        hbm = self.gpu_hbm_bytes_per_s * self.decode_hbm_efficiency
        head_dim = self.hidden_size // self.num_heads
        kv_bytes_per_token = 2 * self.num_layers * self.num_kv_heads * head_dim * self.dtype_bytes
        mean_context = self.prompt_tokens + self.lengths().mean_tokens() / 2
        flops_per_token = 2 * num_params
        return GenerationTime(
            fixed_s=self.gen_fixed_s,
            step_s=param_bytes / hbm,
            token_s=kv_bytes_per_token * mean_context / hbm
            + flops_per_token / (self.gpu_bf16_flops * self.decode_mfu),
            prefill_token_s=flops_per_token
            / (self.gpu_bf16_flops * self.prefill_mfu)
            / self.group_size,
        )

    def learner(self, num_params: int) -> LearnerTime:
        param_bytes = num_params * self.dtype_bytes
        return LearnerTime(
            world=self.world,
            overhead_s=self.learner_overhead_s,
            token_s=6 * num_params / (self.gpu_bf16_flops * self.train_mfu),
            allreduce_s=2 * self._hierarchical_s(param_bytes),
            snapshot_s=self._hierarchical_s(param_bytes),
        )

    def inflight_pause(self, num_params: int) -> tuple[float, float]:
        """(fixed, per sequence) seconds of one in-flight update's pause (see the module)."""
        load_s = (
            2
            * num_params
            * self.dtype_bytes
            / (self.gpu_hbm_bytes_per_s * self.decode_hbm_efficiency)
        )
        per_token_s = 2 * num_params / (self.gpu_bf16_flops * self.prefill_mfu)
        tokens = self.prompt_tokens / self.group_size + self.lengths().mean_tokens() / 2
        return load_s, self.inflight_recompute * tokens * per_token_s

    def _hierarchical_s(self, nbytes: float) -> float:
        """One all-gather (or reduce-scatter) of `nbytes` over the learner's nodes."""
        nodes = max(1, self.world // self.gpus_per_node)
        inside = nbytes * (self.gpus_per_node - 1) / self.gpus_per_node / self.nvlink_bytes_per_s
        across = nbytes / self.gpus_per_node * (nodes - 1) / nodes / self.ib_bytes_per_s
        return inside + across

    def sync(self, plan: BucketPlan) -> WeightSync:
        return WeightSync(
            total_bytes=plan.total_bytes,
            num_buckets=len(plan.buckets),
            bandwidth_bytes_per_s=self.ib_bytes_per_s,
            bucket_latency_s=self.bucket_latency_s,
        )

    def derived(self) -> dict[str, Any]:
        """The time models and sizes these assumptions imply (written next to predictions)."""
        plan = self.bucket_plan()
        num_params = plan.total_bytes // self.dtype_bytes
        return {
            "num_params": num_params,
            "param_bytes": plan.total_bytes,
            "num_buckets": len(plan.buckets),
            "mean_response_tokens": self.lengths().mean_tokens(),
            "generation": asdict(self.generation(num_params)),
            "learner": asdict(self.learner(num_params)),
            "sync": asdict(self.sync(plan)) | {"seconds": self.sync(plan).seconds},
            "inflight_pause_s": dict(
                zip(("fixed", "per_seq"), self.inflight_pause(num_params), strict=True)
            ),
        }
