"""The models whose weights bench/weights.py and bench/weights_world.py move, as parameter
shapes with HF names: a Qwen2-style decoder (`SHAPE`, 207 fp32 tensors, ~68 M parameters) and a
large MoE in miniature (`MANY`, 2,023 tensors, most of them small expert matrices)."""

from __future__ import annotations

SHAPE = {"num_layers": 17, "hidden": 512, "kv_dim": 128, "intermediate": 1536, "vocab": 16384}
MANY = {
    "num_layers": 10,
    "hidden": 128,
    "num_experts": 64,
    "expert_intermediate": 64,
    "vocab": 4096,
}
"""A large MoE's shape in miniature: 2,023 tensors, most of them small expert matrices."""


def model_params(num_layers: int, hidden: int, kv_dim: int, intermediate: int, vocab: int) -> dict:
    """Parameter shapes of a Qwen2-style decoder, HF names."""
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (vocab, hidden)}
    for i in range(num_layers):
        p = f"model.layers.{i}."
        for proj, rows in (("q", hidden), ("k", kv_dim), ("v", kv_dim)):
            shapes[f"{p}self_attn.{proj}_proj.weight"] = (rows, hidden)
            shapes[f"{p}self_attn.{proj}_proj.bias"] = (rows,)
        shapes[f"{p}self_attn.o_proj.weight"] = (hidden, hidden)
        shapes[f"{p}mlp.gate_proj.weight"] = (intermediate, hidden)
        shapes[f"{p}mlp.up_proj.weight"] = (intermediate, hidden)
        shapes[f"{p}mlp.down_proj.weight"] = (hidden, intermediate)
        shapes[f"{p}input_layernorm.weight"] = (hidden,)
        shapes[f"{p}post_attention_layernorm.weight"] = (hidden,)
    shapes["model.norm.weight"] = (hidden,)
    shapes["lm_head.weight"] = (vocab, hidden)
    return shapes


def moe_params(
    num_layers: int, hidden: int, num_experts: int, expert_intermediate: int, vocab: int
) -> dict:
    """Parameter shapes of a Qwen-MoE-style decoder (per-expert matrices), HF names."""
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (vocab, hidden)}
    for i in range(num_layers):
        p = f"model.layers.{i}."
        for proj in ("q", "k", "v", "o"):
            shapes[f"{p}self_attn.{proj}_proj.weight"] = (hidden, hidden)
        for proj in ("q", "k", "v"):
            shapes[f"{p}self_attn.{proj}_proj.bias"] = (hidden,)
        shapes[f"{p}mlp.gate.weight"] = (num_experts, hidden)
        for e in range(num_experts):
            for proj in ("gate", "up"):
                shapes[f"{p}mlp.experts.{e}.{proj}_proj.weight"] = (expert_intermediate, hidden)
            shapes[f"{p}mlp.experts.{e}.down_proj.weight"] = (hidden, expert_intermediate)
        shapes[f"{p}input_layernorm.weight"] = (hidden,)
        shapes[f"{p}post_attention_layernorm.weight"] = (hidden,)
    shapes["model.norm.weight"] = (hidden,)
    shapes["lm_head.weight"] = (vocab, hidden)
    return shapes
