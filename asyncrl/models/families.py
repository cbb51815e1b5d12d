"""Configs of the tiny models asyncrl builds locally, one per model family (`model.arch`).

Every family shares the tiny character tokenizer (asyncrl/models/tiny.py) and the widths of
`ModelConfig`; what differs is what the weight path must get right for it:

| arch        | transformers class   | what it exercises                                          |
| ----------- | -------------------- | ---------------------------------------------------------- |
| `llama`     | LlamaForCausalLM     | the embedded default: untied head, grouped-query attention |
| `qwen2`     | Qwen2ForCausalLM     | q/k/v biases, tied embeddings (one tensor, two names)      |
| `mistral`   | MistralForCausalLM   | a sliding attention window                                 |
| `qwen3`     | Qwen3ForCausalLM     | q/k RMS norms per head, explicit head_dim, tied embeddings |
| `qwen3_moe` | Qwen3MoeForCausalLM  | a sparse MoE: router + per-expert MLPs (`model.num_experts`)|

Nothing here is downloaded: the configs are written from these settings and the weights are
random (seeded by `model.init_seed`).
"""

from __future__ import annotations

from typing import Any

from transformers import PretrainedConfig

from asyncrl.config import ModelConfig


def family_config(
    model: ModelConfig, vocab_size: int, special: dict[str, int], max_positions: int
) -> PretrainedConfig:
    """The transformers config of the tiny `model.arch` model."""
    from transformers import (
        LlamaConfig,
        MistralConfig,
        Qwen2Config,
        Qwen3Config,
        Qwen3MoeConfig,
    )

    common: dict[str, Any] = {
        "vocab_size": vocab_size,
        "hidden_size": model.hidden_size,
        "intermediate_size": model.intermediate_size,
        "num_hidden_layers": model.num_layers,
        "num_attention_heads": model.num_heads,
        "num_key_value_heads": model.num_kv_heads,
        "head_dim": model.hidden_size // model.num_heads,
        "max_position_embeddings": max_positions,
        "bos_token_id": special["bos"],
        "eos_token_id": special["eos"],
        "pad_token_id": special["pad"],
        "torch_dtype": model.dtype,
    }
    if model.arch == "llama":
        return LlamaConfig(**common, tie_word_embeddings=False)
    if model.arch == "qwen2":
        return Qwen2Config(**common, tie_word_embeddings=True, use_sliding_window=False)
    if model.arch == "mistral":
        return MistralConfig(**common, tie_word_embeddings=False, sliding_window=max_positions // 2)
    if model.arch == "qwen3":
        return Qwen3Config(**common, tie_word_embeddings=True, use_sliding_window=False)
    if model.arch == "qwen3_moe":
        return Qwen3MoeConfig(
            **common,
            tie_word_embeddings=False,
            num_experts=model.num_experts,
            num_experts_per_tok=min(2, model.num_experts),
            moe_intermediate_size=model.intermediate_size // 2,
            decoder_sparse_step=1,
            norm_topk_prob=True,
        )
    raise ValueError(f"model.arch: unknown family {model.arch!r}")
