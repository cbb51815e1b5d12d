"""Tools: plain Python functions registered with a JSON schema, and the built-in ones.

```
  @tool("calculator", "Evaluate an arithmetic expression.",
        {"expression": {"type": "string", "description": "e.g. (2 + 3) * 4"}})
  def calculator(expression: str) -> str: ...
```

`tool(...)` registers the function in `TOOLS` under its name; `Toolbox(names)` offers a set of
them to an episode: `schemas()` gives the OpenAI-style function schemas that chat templates
render into the prompt, `call(call, row)` checks the arguments against the schema (required
ones present, no unknown ones, JSON types right) and runs the function. A tool that takes a
keyword-only `row` parameter gets the episode's dataset row (the lookup tool reads its
`info`). Whatever goes wrong (bad arguments, an unknown tool, the function raising) is a failed
`ToolResult` with the reason, never an exception. `quick` tools (pure computation) let an
environment run its steps on the actor's thread; the python tool is not quick.

Built-ins: `calculator` (arithmetic on numbers only, parsed with `ast`: no names, calls or
attributes, so no code runs), `python` (runs the code in the sandbox pool,
actors/sandbox, and returns its output) and `lookup` (a key in the row's `info["table"]`).
"""

from __future__ import annotations

import ast
import inspect
import math
import operator
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from actors.envs.base import Row
from actors.envs.tool_calls import ToolCall, ToolResult

JSON_TYPES: dict[str, tuple[type, ...]] = {
    "string": (str,),
    "number": (int, float),
    "integer": (int,),
    "boolean": (bool,),
    "object": (dict,),
    "array": (list,),
}


class ToolError(Exception):
    """A tool could not do its job; the message is what the model is shown."""


@dataclass(frozen=True)
class Tool:
    """A registered tool: the function, its schema, and whether it is quick."""

    name: str
    description: str
    parameters: dict[str, dict[str, Any]]
    """JSON schema of each argument (all required unless listed in `optional`)."""
    fn: Callable[..., str]
    optional: tuple[str, ...] = ()
    quick: bool = True
    wants_row: bool = False

    def schema(self) -> dict[str, Any]:
        """The OpenAI-style function schema (what chat templates render)."""
        required = [p for p in self.parameters if p not in self.optional]
        return {
            "type": "function",
            "function": {
                "name": self.name,
                "description": self.description,
                "parameters": {
                    "type": "object",
                    "properties": self.parameters,
                    "required": required,
                },
            },
        }


TOOLS: dict[str, Tool] = {}
"""Every registered tool by name."""


def tool(
    name: str,
    description: str,
    parameters: dict[str, dict[str, Any]],
    *,
    optional: Sequence[str] = (),
    quick: bool = True,
) -> Callable[[Callable[..., str]], Callable[..., str]]:
    """Register the decorated function as tool `name` (see the module docstring)."""

    def register(fn: Callable[..., str]) -> Callable[..., str]:
        if name in TOOLS:
            raise ValueError(f"tool {name!r} is registered already")
        wants_row = "row" in inspect.signature(fn).parameters
        TOOLS[name] = Tool(name, description, parameters, fn, tuple(optional), quick, wants_row)
        return fn

    return register


class Toolbox:
    """The tools one episode may call."""

    def __init__(self, names: Sequence[str]) -> None:
        unknown = [n for n in names if n not in TOOLS]
        if unknown:
            raise ValueError(f"task.tools: unknown tool {unknown[0]!r} (known: {sorted(TOOLS)})")
        self.tools = {n: TOOLS[n] for n in names}

    @property
    def quick(self) -> bool:
        """Every tool is quick (the environment may step on the actor's thread)."""
        return all(t.quick for t in self.tools.values())

    def schemas(self) -> tuple[dict[str, Any], ...]:
        return tuple(t.schema() for t in self.tools.values())

    def call(self, call: ToolCall, row: Row) -> ToolResult:
        """Run one call; any failure is a failed result with its reason."""
        start = time.perf_counter()
        found = self.tools.get(call.name)
        if found is None:
            return ToolResult(False, f"unknown tool {call.name!r} (tools: {sorted(self.tools)})")
        problem = check_arguments(found, call.arguments)
        if problem:
            return ToolResult(False, problem)
        kwargs = dict(call.arguments, **({"row": row} if found.wants_row else {}))
        try:
            text = found.fn(**kwargs)
            ok = True
        except ToolError as exc:
            text, ok = str(exc), False
        except Exception as exc:  # a tool's bug is the episode's error, not the actor's
            text, ok = f"tool {call.name} raised {type(exc).__name__}: {exc}", False
        return ToolResult(ok, str(text), time.perf_counter() - start)


def check_arguments(found: Tool, arguments: dict[str, Any]) -> str:
    """Why `arguments` do not fit the tool's schema ("" when they do)."""
    unknown = sorted(set(arguments) - set(found.parameters))
    if unknown:
        return f"{found.name}: unknown argument {unknown[0]!r}"
    for name, spec in found.parameters.items():
        if name not in arguments:
            if name not in found.optional:
                return f"{found.name}: missing argument {name!r}"
            continue
        types = JSON_TYPES.get(spec.get("type", ""), (object,))
        value = arguments[name]
        if not isinstance(value, types) or (isinstance(value, bool) and bool not in types):
            return f"{found.name}: argument {name!r} must be a {spec.get('type')}"
    return ""


# --- built-in tools ---------------------------------------------------------------------------

MAX_EXPRESSION_CHARS = 200
MAX_EXPONENT = 64
MAX_MAGNITUDE = 1e30
_OPS: dict[type, Callable[..., Any]] = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
    ast.Pow: operator.pow,
    ast.USub: operator.neg,
    ast.UAdd: operator.pos,
}


@tool(
    "calculator",
    "Evaluate an arithmetic expression: numbers, + - * / // % ** and parentheses.",
    {"expression": {"type": "string", "description": "for example (2 + 3) * 4"}},
)
def calculator(expression: str) -> str:
    """The value of `expression`, computed from its syntax tree (nothing else is allowed)."""
    if len(expression) > MAX_EXPRESSION_CHARS:
        raise ToolError(f"expression longer than {MAX_EXPRESSION_CHARS} characters")
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except SyntaxError:
        raise ToolError(f"not an arithmetic expression: {expression!r}") from None
    value = _arith(tree.body)
    if isinstance(value, float) and value.is_integer() and abs(value) < 1e15:
        value = int(value)
    return str(value)


def _arith(node: ast.AST) -> int | float:
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return node.value
    if isinstance(node, ast.UnaryOp) and type(node.op) in _OPS:
        return _OPS[type(node.op)](_arith(node.operand))
    if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
        left, right = _arith(node.left), _arith(node.right)
        if isinstance(node.op, ast.Pow) and abs(right) > MAX_EXPONENT:
            raise ToolError(f"exponent larger than {MAX_EXPONENT}")
        try:
            value = _OPS[type(node.op)](left, right)
        except (ZeroDivisionError, OverflowError) as exc:
            raise ToolError(str(exc)) from None
        if isinstance(value, complex) or abs(value) > MAX_MAGNITUDE or not math.isfinite(value):
            raise ToolError("result out of range")
        return value
    raise ToolError(f"only numbers and arithmetic operators are allowed, not {type(node).__name__}")


@tool(
    "lookup",
    "Look up the value stored under a key in this task's table.",
    {"key": {"type": "string", "description": "the key to look up"}},
)
def lookup(key: str, *, row: Row) -> str:
    """`row.info["table"][key]`."""
    table = row.info.get("table")
    if not isinstance(table, dict):
        raise ToolError("this task has no table to look up")
    if key not in table:
        raise ToolError(f"no key {key!r}")
    return str(table[key])


PYTHON_OUTPUT_CHARS = 2000


@tool(
    "python",
    "Run a Python program in a sandbox (no network, limited time and memory); returns what it "
    "prints.",
    {"code": {"type": "string", "description": "the program"}},
    quick=False,
)
def python(code: str) -> str:
    """Run `code` in the shared sandbox pool; its output (and status when not ok)."""
    try:
        from actors.sandbox import shared_pool
    except ImportError as exc:
        raise ToolError(f"the python tool needs the sandbox (actors.sandbox): {exc}") from None
    result = shared_pool().run(code)
    out = result.stdout + (result.stderr if result.status != "ok" else "")
    if len(out) > PYTHON_OUTPUT_CHARS:
        out = out[:PYTHON_OUTPUT_CHARS] + f"\n[... {len(out) - PYTHON_OUTPUT_CHARS} more chars]"
    if result.status != "ok":
        return f"[{result.status}, exit code {result.exit_code}]\n{out}"
    return out
