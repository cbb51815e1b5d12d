"""What every message module shares: the protocol version, limits, enumerations,
`ProtocolError`, and the two field markers (`array_field` for an array carried in a frame of
its own, `appended_field` for a field appended to an existing message, off the wire at its
default)."""

from __future__ import annotations

from dataclasses import field
from typing import Any

PROTOCOL_VERSION = 3  # 2: a Batch embeds its groups as whole Group messages; 3: packed Batch
DEFAULT_MAX_MESSAGE_BYTES = 256 * 1024 * 1024
FINISH_REASONS = ("stop", "length", "abort", "error", "turn_limit", "tool_error", "timeout")
ROLES = ("actor", "learner", "client")


class ProtocolError(Exception):
    """A message that cannot be accepted; `field` names the offending part."""

    def __init__(self, field: str, detail: str, code: str = "bad_message") -> None:
        super().__init__(f"{field}: {detail}")
        self.field = field
        self.detail = detail
        self.code = code


def array_field(dtype: str, ndim: int = 1) -> Any:
    """An array field: sent in a frame of its own, its dtype and number of dimensions checked on
    decode."""
    return field(metadata={"dtype": dtype, "ndim": ndim})


def appended_field(default: Any = None, *, factory: Any = None) -> Any:
    """A field appended to an existing message: off the wire while it holds its default."""
    if factory is not None:
        return field(default_factory=factory, metadata={"omit_default": True})
    return field(default=default, metadata={"omit_default": True})
