"""Tool calls in a model's turn: parsing them, and writing the tools' answers back.

Two call syntaxes, one interface (`CallSyntax`):

- `JsonCalls`, for chat models (the Hermes / Qwen convention): each call is
  ``<tool_call>{"name": "calculator", "arguments": {"expression": "2+3"}}</tool_call>``;
  results go back as one `tool` message per call.
- `CompactCalls`, for a tiny model that has to discover tool use by itself: a turn that starts
  with the marker (``?7``) calls one fixed tool with the rest of the turn as its one argument;
  the result goes back as raw text (``=382=``, or ``!:`` for an error).

A call that cannot be understood (bad JSON, no name, arguments that are not an object, an
opening tag with no closing one because the turn was cut off, a marker with nothing after it)
is never an exception and never dropped: it becomes a `malformed` entry whose error text the
model sees in place of a result, and the environment counts it.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from actors.envs.base import Observation


@dataclass(frozen=True)
class ToolCall:
    """One well-formed call: a tool name and its arguments."""

    name: str
    arguments: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class ParsedTurn:
    """What a turn holds: calls in order (a malformed one as its error text), and the rest."""

    calls: tuple[ToolCall | str, ...]
    """Each call, or for a malformed one the error text to show the model."""
    answer: str
    """The turn's text outside the calls (the final answer when there are no calls)."""

    @property
    def num_malformed(self) -> int:
        return sum(1 for c in self.calls if isinstance(c, str))


@dataclass(frozen=True)
class ToolResult:
    """A tool's answer to one call (`ok` False: `text` says what went wrong)."""

    ok: bool
    text: str
    seconds: float = 0.0


class CallSyntax(Protocol):
    """How calls are written by the model and how results are written back."""

    def parse(self, text: str) -> ParsedTurn:
        """The calls in one model turn (never raises)."""
        ...

    def observation(self, results: Sequence[ToolResult]) -> Observation:
        """The observation that answers a turn's calls, in order."""
        ...


OPEN, CLOSE = "<tool_call>", "</tool_call>"
_BLOCK = re.compile(re.escape(OPEN) + r"(.*?)" + re.escape(CLOSE), re.DOTALL)


class JsonCalls:
    """``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` blocks; `tool` messages back."""

    def parse(self, text: str) -> ParsedTurn:
        calls: list[ToolCall | str] = []
        for block in _BLOCK.finditer(text):
            calls.append(parse_json_call(block.group(1)))
        rest = _BLOCK.sub("", text)
        if OPEN in rest:  # an opening tag never closed: the turn was cut off mid-call
            calls.append(f"truncated tool call (no {CLOSE})")
            rest = rest.split(OPEN, 1)[0]
        return ParsedTurn(calls=tuple(calls), answer=rest.strip())

    def observation(self, results: Sequence[ToolResult]) -> Observation:
        messages = tuple(
            {"role": "tool", "content": r.text if r.ok else f"error: {r.text}"} for r in results
        )
        return Observation(messages=messages)


def parse_json_call(body: str) -> ToolCall | str:
    """One call's JSON, or the error text of a malformed one."""
    try:
        obj = json.loads(body)
    except json.JSONDecodeError as exc:
        return f"malformed tool call: not valid JSON ({exc.msg})"
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        return 'malformed tool call: needs {"name": string, "arguments": object}'
    arguments = obj.get("arguments", {})
    if isinstance(arguments, str):  # some models write the arguments as a JSON string
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError:
            return "malformed tool call: arguments are not a JSON object"
    if not isinstance(arguments, dict):
        return "malformed tool call: arguments must be an object"
    return ToolCall(name=obj["name"], arguments=arguments)


@dataclass(frozen=True)
class CompactCalls:
    """A turn starting with `marker` calls `tool`; its argument `argument` is the run of
    `argument_chars` after the marker (everything after it, when `argument_chars` is empty)."""

    tool: str = "lookup"
    argument: str = "key"
    marker: str = "?"
    argument_chars: str = ""
    ok_format: str = "={}="
    """Result text around the tool's answer (raw text appended after the call)."""
    error_text: str = "!:"
    """What the model sees for a failed or malformed call."""

    def parse(self, text: str) -> ParsedTurn:
        text = text.strip()
        if not text.startswith(self.marker):
            return ParsedTurn(calls=(), answer=text)
        arg = text[len(self.marker) :].strip()
        if self.argument_chars:
            end = next((i for i, c in enumerate(arg) if c not in self.argument_chars), len(arg))
            arg = arg[:end]
        if not arg:
            return ParsedTurn(calls=("malformed call: no argument",), answer="")
        return ParsedTurn(calls=(ToolCall(self.tool, {self.argument: arg}),), answer="")

    def observation(self, results: Sequence[ToolResult]) -> Observation:
        text = "".join(self.ok_format.format(r.text) if r.ok else self.error_text for r in results)
        return Observation(text=text)
