"""Bucket plan invariants (hypothesis), buffer packing, and plan agreement learner vs actor."""

from __future__ import annotations

import random
import subprocess
import sys
from pathlib import Path

import msgpack
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from asyncrl.weights.bucket_plan import (
    DTYPE_BYTES,
    BucketPlan,
    allocate_buckets,
    allocate_staging,
    pack,
    params_from_module,
    params_from_safetensors,
    staged_buckets,
    unpack,
)

DTYPES = ["float32", "bfloat16", "float16", "int64", "uint8"]

shapes = st.lists(st.integers(0, 40), min_size=0, max_size=3).map(tuple)
param_lists = st.lists(
    st.tuples(st.text("abc.0123456789", min_size=1, max_size=12), shapes, st.sampled_from(DTYPES)),
    min_size=1,
    max_size=40,
    unique_by=lambda p: p[0],
)
bucket_sizes = st.integers(1, 4096)


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


@given(param_lists, bucket_sizes)
def test_every_byte_is_covered_exactly_once(params: list, bucket_bytes: int) -> None:
    plan = BucketPlan.from_params(params, bucket_bytes)
    assert sorted(name for name, _, _ in plan.params()) == sorted(name for name, _, _ in params)
    assert plan.total_bytes == sum(_numel(s) * DTYPE_BYTES[d] for _, s, d in params)
    for bucket in plan.buckets:
        cursor = 0
        for entry in bucket.entries:  # back to back: no gap, no overlap
            assert entry.offset == cursor and entry.numel == _numel(entry.shape)
            cursor += entry.numel
        assert cursor == bucket.numel


@given(param_lists, bucket_sizes)
def test_buckets_respect_the_limit_and_are_packed_greedily(params: list, bucket_bytes: int) -> None:
    plan = BucketPlan.from_params(params, bucket_bytes)
    limit = {d: max(1, bucket_bytes // DTYPE_BYTES[d]) for d in DTYPES}
    for bucket in plan.buckets:
        assert bucket.numel <= limit[bucket.dtype] or len(bucket.entries) == 1
    for a, b in zip(plan.buckets, plan.buckets[1:], strict=False):
        if a.dtype == b.dtype:  # b's first tensor did not fit into a
            assert a.numel + b.entries[0].numel > limit[a.dtype]


@given(param_lists, bucket_sizes)
def test_buckets_hold_one_dtype_in_sorted_dtype_order(params: list, bucket_bytes: int) -> None:
    plan = BucketPlan.from_params(params, bucket_bytes)
    dtypes = [b.dtype for b in plan.buckets]
    assert dtypes == sorted(dtypes)
    specs = {name: dtype for name, _, dtype in params}
    assert all(specs[e.name] == b.dtype for b in plan.buckets for e in b.entries)
    assert [b.index for b in plan.buckets] == list(range(len(plan.buckets)))


@given(param_lists, bucket_sizes, st.randoms(use_true_random=False))
def test_plan_and_hash_do_not_depend_on_input_order(
    params: list, bucket_bytes: int, rnd: random.Random
) -> None:
    shuffled = list(params)
    rnd.shuffle(shuffled)
    a, b = (
        BucketPlan.from_params(params, bucket_bytes),
        BucketPlan.from_params(shuffled, bucket_bytes),
    )
    assert a == b and a.plan_hash == b.plan_hash


@given(param_lists, bucket_sizes)
def test_wire_round_trip_through_msgpack(params: list, bucket_bytes: int) -> None:
    plan = BucketPlan.from_params(params, bucket_bytes)
    wire = msgpack.unpackb(msgpack.packb(plan.to_wire()))
    again = BucketPlan.from_wire(wire)
    assert again == plan and again.plan_hash == plan.plan_hash


def test_hash_is_pinned_and_tracks_the_layout() -> None:
    params = [("b", (3, 4), "float32"), ("a", (5,), "float32"), ("c", (2,), "bfloat16")]
    plan = BucketPlan.from_params(params, 48)
    assert plan.plan_hash == BucketPlan.from_params(list(params), 48).plan_hash
    assert len(plan.plan_hash) == 64
    changed_shape = [("b", (4, 3), "float32"), *params[1:]]
    assert BucketPlan.from_params(changed_shape, 48).plan_hash != plan.plan_hash
    assert BucketPlan.from_params(params, 4096).plan_hash != plan.plan_hash


def test_oversize_tensor_gets_its_own_bucket() -> None:
    plan = BucketPlan.from_params(
        [("a", (2,), "float32"), ("b", (100,), "float32"), ("c", (2,), "float32")], 64
    )
    assert [[e.name for e in b.entries] for b in plan.buckets] == [["a"], ["b"], ["c"]]


def test_names_sort_naturally() -> None:
    names = [f"model.layers.{i}.w" for i in (10, 2, 1)]
    plan = BucketPlan.from_params([(n, (1,), "float32") for n in names], 1 << 20)
    assert [n for n, _, _ in plan.params()] == [f"model.layers.{i}.w" for i in (1, 2, 10)]


@pytest.mark.parametrize(
    ("params", "message"),
    [
        ([], "no parameters"),
        ([("a", (1,), "float32"), ("a", (2,), "float32")], "listed twice"),
        ([("a", (1,), "complex64")], "unsupported dtype"),
        ([("a", (-1,), "float32")], "negative dimension"),
    ],
)
def test_bad_parameter_lists_are_refused(params: list, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        BucketPlan.from_params(params, 1024)


def test_tampered_wire_hash_is_refused() -> None:
    wire = BucketPlan.from_params([("a", (4,), "float32")], 1024).to_wire()
    wire["plan_hash"] = "0" * 64
    with pytest.raises(ValueError, match="0000"):
        BucketPlan.from_wire(wire)


def _random_tensors(params: list, seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    out = {}
    for name, shape, dtype in params:
        raw = torch.randint(
            0, 256, (_numel(shape) * DTYPE_BYTES[dtype],), dtype=torch.uint8, generator=g
        )
        out[name] = raw.view(getattr(torch, dtype)).view(shape)  # arbitrary bits, NaNs included
    return out


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (
        a.shape == b.shape
        and a.dtype == b.dtype
        and torch.equal(a.view(torch.uint8), b.view(torch.uint8))
    )


@settings(max_examples=50)
@given(param_lists, bucket_sizes)
def test_pack_then_unpack_gives_back_the_same_bits(params: list, bucket_bytes: int) -> None:
    plan = BucketPlan.from_params(params, bucket_bytes)
    tensors = _random_tensors(params, seed=bucket_bytes)
    buffers = allocate_buckets(plan)
    pack(plan, tensors, buffers)
    back = dict(unpack(plan, buffers))
    assert back.keys() == tensors.keys()
    assert all(_same_bits(back[n].reshape(-1), tensors[n].reshape(-1)) for n in tensors)
    staged = [b.clone() for b in staged_buckets(plan, tensors, allocate_staging(plan))]
    assert all(_same_bits(s, b) for s, b in zip(staged, buffers, strict=True))


def test_pack_refuses_missing_extra_and_mistyped_tensors() -> None:
    plan = BucketPlan.from_params([("a", (2, 2), "float32")], 1024)
    buffers = allocate_buckets(plan)
    with pytest.raises(ValueError, match="'a' of the plan is missing"):
        pack(plan, {}, buffers)
    with pytest.raises(ValueError, match="not in the plan"):
        pack(plan, {"a": torch.zeros(2, 2), "z": torch.zeros(1)}, buffers)
    with pytest.raises(ValueError, match="plan says"):
        pack(plan, {"a": torch.zeros(2, 2, dtype=torch.float64)}, buffers)


def test_import_pulls_in_no_torch() -> None:
    code = "import asyncrl.weights.bucket_plan, sys; assert 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)


@pytest.mark.parametrize(("tied", "dtype"), [(True, torch.float32), (False, torch.bfloat16)])
def test_safetensors_headers_and_named_parameters_agree(
    tmp_path: Path, tied: bool, dtype: torch.dtype
) -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=64,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=3,
        num_attention_heads=2,
        num_key_value_heads=1,
        tie_word_embeddings=tied,
    )
    model = LlamaForCausalLM(config).to(dtype)
    model.save_pretrained(tmp_path)
    learner = BucketPlan.from_params(params_from_module(model), 8192)
    actor = BucketPlan.from_params(params_from_safetensors(tmp_path), 8192)
    assert actor == learner and actor.plan_hash == learner.plan_hash
    assert ("lm_head.weight" in [n for n, _, _ in learner.params()]) is not tied


def test_the_embedded_tiny_llama_gives_one_plan_on_both_sides(tiny_model_dir: Path) -> None:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    learner = BucketPlan.from_params(params_from_module(model), 64 * 1024)
    actor = BucketPlan.from_params(params_from_safetensors(tiny_model_dir), 64 * 1024)
    assert actor.plan_hash == learner.plan_hash and len(actor.buckets) > 1
