"""The `lookup` task: the answer is a value only a tool call can reveal.

Each row holds a small table of random keys and values in `info["table"]`; the prompt names
one key, ``"7:"``. The value is drawn at random per row (`task.num_digits` digits), so nothing
in the prompt predicts it: the model has to call the lookup tool and copy what it returns.
Raw text and a compact call syntax (actors/envs/tool_calls.py `CompactCalls`) keep an episode
within reach of the tiny model's character tokenizer (it needs `model.extra_chars = "?=!"`):

```
  prompt          <bos>7:                 loss_mask -
  model turn 1    ?7<eos>                 1 1 1      a call: lookup(key="7")
  observation     =382=                   0 0 0 0 0  the tool's answer (`!:` for an error)
  model turn 2    382<eos>                1 1 1 1    the answer: the episode ends
```

The call's argument is the run of digits after the marker (``?7`` followed by anything else
still looks up "7"). Reward (in [0, 1]): `CALL_CREDIT` for calling the lookup tool at all,
`KEY_CREDIT` more for calling it with the prompt's key, plus the rest times the share of the
value's digits the answer has in the right places (divided by the longer of answer and value,
so padding never pays, as in the sort task). The answer is the run of digits the model's final
turn starts with (what follows it, up to the turn's token limit, is ignored). A model that
never calls the tool scores only what guessing digits gives; the full reward needs the value.
The call credits are the shaping that lets a random model discover the call.
"""

from __future__ import annotations

import random
import re
from typing import Any

from actors.envs.base import Row
from actors.envs.tool_calls import CompactCalls
from actors.envs.tool_env import History, ToolEnv
from actors.envs.toolbox import Toolbox
from asyncrl.config import TaskConfig

CALL_CREDIT = 0.1
"""Share of the reward for calling the lookup tool."""
KEY_CREDIT = 0.1
"""Share of the reward for calling it with the prompt's key."""
NUM_KEYS = 3
"""Keys in each row's table (the prompt names one of them)."""
EXTRA_CHARS = "?=!"
"""Characters the task writes beyond the tiny model's digits, ':' and ' '."""


def make_rows(task: TaskConfig) -> list[Row]:
    """`task.num_prompts` rows, deterministic in `task.seed`."""
    rng = random.Random(task.seed)
    rows = []
    for index in range(task.num_prompts):
        keys = rng.sample("0123456789", NUM_KEYS)
        table = {k: "".join(rng.choice("0123456789") for _ in range(task.num_digits)) for k in keys}
        key = rng.choice(keys)
        rows.append(
            Row(
                prompt_id=f"lookup-{task.num_digits}-{task.seed}-{index:06d}",
                prompt=f"{key}:",
                answer=table[key],
                info={"key": key, "table": table},
            )
        )
    return rows


def lookup_reward(row: Row, answer: str, history: History) -> tuple[float, dict[str, Any]]:
    """The reward of the module docstring, with its parts."""
    key, value = str(row.info["key"]), str(row.answer)
    called = any(c.name == "lookup" for c, _ in history)
    right_key = any(c.name == "lookup" and c.arguments.get("key") == key for c, _ in history)
    pred = re.match(r"\d*", answer.strip()).group()  # type: ignore[union-attr]
    length = max(len(pred), len(value), 1)
    position = sum(p == v for p, v in zip(pred, value, strict=False)) / length
    rest = 1.0 - CALL_CREDIT - KEY_CREDIT
    reward = CALL_CREDIT * called + KEY_CREDIT * right_key + rest * position
    return reward, {"called": called, "right_key": right_key, "position": position, "pred": pred}


def make_env(task: TaskConfig) -> ToolEnv:
    """The registry's factory of `lookup` episodes."""
    return ToolEnv(
        Toolbox(task.tools or ("lookup",)),
        CompactCalls(tool="lookup", argument="key", argument_chars="0123456789"),
        lookup_reward,
        max_tool_calls=task.max_tool_calls,
        max_tool_errors=task.max_tool_errors,
        raw_text=True,
    )
