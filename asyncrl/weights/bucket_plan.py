"""The bucket plan: which parameter goes into which flat broadcast buffer, at which offset.

Sender and receivers compute the plan independently from the parameter list (name, shape,
dtype) and compare `plan_hash`, which travels in every weights announcement. The plan is a pure
function of the *set* of parameters and `bucket_bytes`:

- parameters are grouped by dtype (dtypes in sorted order) and, within a dtype, ordered by
  name in natural order (``layers.2`` before ``layers.10``). The order in which the parameters
  are given does not matter, so a learner listing `named_parameters()` (module order) and an
  actor reading safetensors headers (file order) arrive at the same plan;
- each dtype's parameters are packed back to back into flat buckets of at most `bucket_bytes`;
  a bucket never mixes dtypes; a single tensor larger than `bucket_bytes` gets a bucket of its
  own.

Offsets and sizes are in elements of the bucket's dtype. This module imports no torch at
import time (the hub may load it); the pack/unpack helpers import torch when called.
"""

from __future__ import annotations

import hashlib
import json
import re
import struct
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

ParamSpec = tuple[str, tuple[int, ...], str]
"""(name, shape, dtype) where dtype is a torch dtype name without the `torch.` prefix."""

DTYPE_BYTES = {
    "float64": 8,
    "float32": 4,
    "float16": 2,
    "bfloat16": 2,
    "float8_e4m3fn": 1,
    "float8_e5m2": 1,
    "int64": 8,
    "int32": 4,
    "int16": 2,
    "int8": 1,
    "uint8": 1,
    "bool": 1,
}
"""Bytes per element of every dtype a plan may hold."""

SAFETENSORS_DTYPES = {
    "F64": "float64",
    "F32": "float32",
    "F16": "float16",
    "BF16": "bfloat16",
    "F8_E4M3": "float8_e4m3fn",
    "F8_E5M2": "float8_e5m2",
    "I64": "int64",
    "I32": "int32",
    "I16": "int16",
    "I8": "int8",
    "U8": "uint8",
    "BOOL": "bool",
}
"""safetensors header dtype codes -> plan dtype names."""


@dataclass(frozen=True)
class Entry:
    """One parameter inside a bucket: elements [offset, offset + numel) of the flat buffer."""

    name: str
    shape: tuple[int, ...]
    offset: int
    numel: int


@dataclass(frozen=True)
class Bucket:
    """One flat buffer of a single dtype holding consecutive parameters."""

    index: int
    dtype: str
    numel: int
    entries: tuple[Entry, ...]

    @property
    def nbytes(self) -> int:
        """Size of the flat buffer in bytes."""
        return self.numel * DTYPE_BYTES[self.dtype]


@dataclass(frozen=True)
class BucketPlan:
    """The layout of all parameters in flat buckets; build it with `from_params`."""

    bucket_bytes: int
    buckets: tuple[Bucket, ...]

    @classmethod
    def from_params(cls, params: Iterable[ParamSpec], bucket_bytes: int) -> BucketPlan:
        """Pack (name, shape, dtype) triples into buckets of at most `bucket_bytes` bytes."""
        if bucket_bytes < 1:
            raise ValueError(f"bucket_bytes: must be >= 1, got {bucket_bytes}")
        specs = _validated(params)
        buckets: list[Bucket] = []
        for dtype in sorted({dtype for _, _, dtype in specs}):
            # natural order; the name itself breaks ties (`0` and `00` have one natural key)
            group = sorted(
                (s for s in specs if s[2] == dtype), key=lambda s: (_natural_key(s[0]), s[0])
            )
            limit = max(1, bucket_bytes // DTYPE_BYTES[dtype])
            for entries in _pack(group, limit):
                numel = sum(e.numel for e in entries)
                buckets.append(Bucket(len(buckets), dtype, numel, tuple(entries)))
        return cls(bucket_bytes, tuple(buckets))

    @cached_property
    def plan_hash(self) -> str:
        """sha256 (hex) of the canonical layout: bucket_bytes, dtypes, names, shapes, offsets."""
        layout = [
            self.bucket_bytes,
            [
                [b.dtype, b.numel, [[e.name, list(e.shape), e.offset] for e in b.entries]]
                for b in self.buckets
            ],
        ]
        blob = json.dumps(layout, separators=(",", ":")).encode()
        return hashlib.sha256(blob).hexdigest()

    @property
    def total_bytes(self) -> int:
        """Bytes of all buckets together (= bytes of all parameters)."""
        return sum(b.nbytes for b in self.buckets)

    @property
    def num_tensors(self) -> int:
        """Number of parameters in the plan."""
        return sum(len(b.entries) for b in self.buckets)

    def params(self) -> list[ParamSpec]:
        """The (name, shape, dtype) triples in plan order."""
        return [(e.name, e.shape, b.dtype) for b in self.buckets for e in b.entries]

    def to_wire(self) -> dict[str, Any]:
        """A msgpack-able description from which `from_wire` rebuilds the same plan."""
        params = [[name, list(shape), dtype] for name, shape, dtype in self.params()]
        return {"bucket_bytes": self.bucket_bytes, "params": params, "plan_hash": self.plan_hash}

    @classmethod
    def from_wire(cls, wire: Mapping[str, Any]) -> BucketPlan:
        """Rebuild a plan from `to_wire` output; the carried hash must match the rebuilt one."""
        try:
            params = [
                (str(n), tuple(int(d) for d in shape), str(t)) for n, shape, t in wire["params"]
            ]
            plan = cls.from_params(params, int(wire["bucket_bytes"]))
            claimed = str(wire["plan_hash"])
        except (KeyError, TypeError) as exc:
            raise ValueError(f"bucket plan: malformed wire description ({exc!r})") from exc
        if plan.plan_hash != claimed:
            raise ValueError(f"bucket plan: hash {claimed} on the wire, {plan.plan_hash} rebuilt")
        return plan


def _validated(params: Iterable[ParamSpec]) -> list[ParamSpec]:
    specs: list[ParamSpec] = []
    seen: set[str] = set()
    for name, shape, dtype in params:
        if name in seen:
            raise ValueError(f"bucket plan: parameter {name!r} listed twice")
        if dtype not in DTYPE_BYTES:
            raise ValueError(f"bucket plan: {name}: unsupported dtype {dtype!r}")
        if any(d < 0 for d in shape):
            raise ValueError(f"bucket plan: {name}: negative dimension in shape {shape}")
        seen.add(name)
        specs.append((name, tuple(int(d) for d in shape), dtype))
    if not specs:
        raise ValueError("bucket plan: no parameters")
    return specs


def _pack(group: Sequence[ParamSpec], limit_numel: int) -> Iterator[list[Entry]]:
    """Greedy first-fit in order; an oversize tensor closes the bucket and sits alone."""
    current: list[Entry] = []
    used = 0
    for name, shape, _ in group:
        numel = _numel(shape)
        if current and used + numel > limit_numel:
            yield current
            current, used = [], 0
        current.append(Entry(name, shape, used, numel))
        used += numel
    if current:
        yield current


def _numel(shape: Sequence[int]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def _natural_key(name: str) -> tuple[tuple[int, int | str], ...]:
    """`layers.10.w` sorts after `layers.2.w`; ints and strings never compare directly."""
    return tuple((0, int(p)) if p.isdigit() else (1, p) for p in re.split(r"(\d+)", name))


# ---------------------------------------------------------------------------------------------
# Parameter lists, from either side
# ---------------------------------------------------------------------------------------------


def params_from_module(module: torch.nn.Module) -> list[ParamSpec]:
    """(name, shape, dtype) of `module.named_parameters()` (tied weights listed once) in the
    checkpoint layout the actors load (asyncrl/weights/hf_layout.py: MoE experts one by one)."""
    from asyncrl.weights.hf_layout import checkpoint_tensors

    return [
        (n, tuple(p.shape), str(p.dtype).removeprefix("torch."))
        for n, p in checkpoint_tensors(module.named_parameters())
    ]


def params_from_safetensors(model_dir: str | Path) -> list[ParamSpec]:
    """(name, shape, dtype) from the headers of a HF model directory's safetensors files.

    Reads only the JSON headers (no tensor data, no torch), so an actor derives the learner's
    plan without loading the model.
    """
    files = sorted(Path(model_dir).expanduser().glob("*.safetensors"))
    if not files:
        raise ValueError(f"{model_dir}: no *.safetensors files")
    specs: list[ParamSpec] = []
    for path in files:
        for name, info in _safetensors_header(path).items():
            if name == "__metadata__":
                continue
            code = info["dtype"]
            if code not in SAFETENSORS_DTYPES:
                raise ValueError(f"{path}: {name}: unsupported safetensors dtype {code!r}")
            specs.append((name, tuple(info["shape"]), SAFETENSORS_DTYPES[code]))
    return specs


def _safetensors_header(path: Path) -> dict[str, Any]:
    with path.open("rb") as f:
        raw = f.read(8)
        if len(raw) != 8:
            raise ValueError(f"{path}: truncated safetensors header")
        (size,) = struct.unpack("<Q", raw)
        if size > 100 * 1024 * 1024:
            raise ValueError(f"{path}: safetensors header of {size} bytes is implausible")
        return json.loads(f.read(size))


# ---------------------------------------------------------------------------------------------
# Buffers: pack named tensors into buckets, view buckets as named tensors
# ---------------------------------------------------------------------------------------------


def torch_dtype(dtype: str) -> torch.dtype:
    """The torch dtype of a plan dtype name."""
    import torch

    return getattr(torch, dtype)


def allocate_buckets(plan: BucketPlan, device: str | torch.device = "cpu") -> list[torch.Tensor]:
    """One uninitialised flat buffer per bucket."""
    import torch

    return [torch.empty(b.numel, dtype=torch_dtype(b.dtype), device=device) for b in plan.buckets]


def pack_bucket(bucket: Bucket, tensors: Mapping[str, torch.Tensor], out: torch.Tensor) -> None:
    """Copy the bucket's parameters from `tensors` (by name) into the flat buffer `out`."""
    for e in bucket.entries:
        src = tensors.get(e.name)
        if src is None:
            raise ValueError(f"pack: parameter {e.name!r} of the plan is missing")
        if tuple(src.shape) != e.shape or src.dtype != out.dtype:
            raise ValueError(
                f"pack: {e.name}: got {tuple(src.shape)} {src.dtype}, plan says {e.shape} {out.dtype}"
            )
        out[e.offset : e.offset + e.numel].view(e.shape).copy_(src)


def pack(
    plan: BucketPlan, tensors: Mapping[str, torch.Tensor], out: Sequence[torch.Tensor]
) -> None:
    """Pack every bucket; `tensors` must hold exactly the plan's parameters."""
    import torch

    extra = set(tensors) - {e.name for b in plan.buckets for e in b.entries}
    if extra:
        raise ValueError(f"pack: parameters not in the plan: {sorted(extra)[:5]}")
    with torch.no_grad():
        for bucket, buf in zip(plan.buckets, out, strict=True):
            pack_bucket(bucket, tensors, buf)


def staged_buckets(
    plan: BucketPlan,
    tensors: Mapping[str, torch.Tensor],
    staging: Mapping[str, Sequence[torch.Tensor]],
) -> Iterator[torch.Tensor]:
    """Yield each bucket packed into one of two alternating staging buffers per dtype.

    Bucket k reuses the buffer of bucket k-2 of its dtype, so a consumer may hold at most two
    yielded buffers at once (it must be done with bucket k before asking for bucket k+2).
    `staging[dtype]` holds two flat buffers of at least `max_bucket_numel(plan, dtype)`.
    """
    import torch

    used = {dtype: 0 for dtype in staging}
    for bucket in plan.buckets:
        slot = staging[bucket.dtype][used[bucket.dtype] % 2][: bucket.numel]
        used[bucket.dtype] += 1
        with torch.no_grad():
            pack_bucket(bucket, tensors, slot)
        yield slot


def allocate_staging(
    plan: BucketPlan, device: str | torch.device = "cpu"
) -> dict[str, list[torch.Tensor]]:
    """Two flat staging buffers per dtype, each as large as that dtype's largest bucket."""
    import torch

    dtypes = sorted({b.dtype for b in plan.buckets})
    return {
        d: [
            torch.empty(max_bucket_numel(plan, d), dtype=torch_dtype(d), device=device)
            for _ in range(2)
        ]
        for d in dtypes
    }


def max_bucket_numel(plan: BucketPlan, dtype: str) -> int:
    """Elements of the largest bucket of `dtype` (0 if none)."""
    return max((b.numel for b in plan.buckets if b.dtype == dtype), default=0)


def unpack_bucket(bucket: Bucket, buf: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
    """Named views into the flat buffer `buf` (no copy)."""
    return [(e.name, buf[e.offset : e.offset + e.numel].view(e.shape)) for e in bucket.entries]


def unpack(plan: BucketPlan, buffers: Sequence[torch.Tensor]) -> list[tuple[str, torch.Tensor]]:
    """Named views into all bucket buffers, in plan order."""
    return [
        nt for b, buf in zip(plan.buckets, buffers, strict=True) for nt in unpack_bucket(b, buf)
    ]
