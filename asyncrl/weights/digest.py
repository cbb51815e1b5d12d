"""A content hash of named tensors, to check that actors hold exactly the learner's weights."""

from __future__ import annotations

import hashlib
from collections.abc import Iterable
from typing import Any


def digest_named_tensors(named: Iterable[tuple[str, Any]]) -> str:
    """sha256 over (name, dtype, shape, raw bytes) of every tensor, in name order."""
    h = hashlib.sha256()
    for name, tensor in sorted(named, key=lambda item: item[0]):
        update_digest(h, name, tensor)
    return h.hexdigest()[:32]


def update_digest(h: Any, name: str, tensor: Any) -> None:
    """Feed one named tensor into the sha256 `h` (callers go in name order)."""
    t = tensor.detach().contiguous().cpu()
    h.update(f"{name}|{t.dtype}|{tuple(t.shape)}|".encode())
    h.update(t.view(-1).view(dtype=__import__("torch").uint8).numpy().tobytes())
