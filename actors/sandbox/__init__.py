"""Sandboxed execution of untrusted Python code (pool.py) and code verification (code_check.py).

No torch here: the sandbox is imported by actors, the `sandbox` and `score` commands, and benches.
"""

from actors.sandbox.pool import (
    ExecResult,
    Sandbox,
    SandboxError,
    SandboxLimits,
    isolation_problem,
    shared_pool,
)

__all__ = [
    "ExecResult",
    "Sandbox",
    "SandboxError",
    "SandboxLimits",
    "isolation_problem",
    "shared_pool",
]
