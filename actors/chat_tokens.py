"""Observations as tokens: the first rendered whole, every later one on its own (a delta).

Token in, token out: an episode's tokens are the prompt's tokens, then the engine's own ids for
each model turn and the tokens of each later observation, tokenized by itself. Nothing is ever
re-rendered or re-tokenized as a whole chat, so BPE merges across a turn boundary and chat
templates that rewrite past turns (dropping earlier reasoning, say) cannot make the trajectory
differ from what the engine saw and produced.

```
  first observation   messages + tools --chat template (add_generation_prompt)--> text --> ids
                      raw text        --tokenizer (bos as the tokenizer adds it)--------> ids
  model turn          engine ids, as generated (stop token included)
  later observation   delta of the chat template (below) or raw text --> ids (no bos)
```

The delta of new messages is what the template writes after an assistant turn's end token and
up to the next generation prompt. It is taken from renders of a fixed stand-in conversation
(system, user, assistant "x"): render it with the new messages and a generation prompt, cut
right after the stand-in assistant's end-of-turn token (the tokenizer's eos). Templates that
add a default system prompt or treat past reasoning specially see the same stand-in in both
renders. A template whose render does not continue the stand-in's text up to that cut is
refused with a `ValueError` (it cannot be rendered incrementally).

Without a chat template, messages are their contents joined by newlines (tool schemas, if any,
as JSON lines before them).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from actors.envs.base import Observation

KNOWN_TEXTS = 4096  # texts whose ids are remembered

STAND_IN: tuple[dict[str, str], ...] = (
    {"role": "system", "content": "x"},
    {"role": "user", "content": "x"},
    {"role": "assistant", "content": "x"},
)


class ChatTokens:
    """Tokens of observations for one tokenizer (with or without a chat template)."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.chat = bool(getattr(tokenizer, "chat_template", None))
        eos = tokenizer.eos_token_id
        self.stop_ids: tuple[int, ...] = tuple(eos) if isinstance(eos, list) else (int(eos),)
        self._cut: tuple[str, int] | None = None  # (stand-in prefix, cut position)
        self._backend = getattr(tokenizer, "backend_tokenizer", None)
        """The fast tokenizer's own encoder (what `tokenizer(text)` runs, without its
        per-call overhead), when the tokenizer has one."""
        self._known: dict[tuple[str, bool], list[int]] = {}
        """Ids of texts seen before (observations repeat: template deltas, tool results)."""

    def first(self, obs: Observation) -> list[int]:
        """Token ids of the prompt (the episode's first observation)."""
        if obs.messages:
            if self.chat:
                text = self.tokenizer.apply_chat_template(
                    list(obs.messages),
                    tools=list(obs.tools) or None,
                    add_generation_prompt=True,
                    tokenize=False,
                )
                return self.encode(text)
            return self.encode(_tools_text(obs.tools) + _joined(obs.messages), special=True)
        if obs.text:
            return self.encode(obs.text, special=True)
        raise ValueError("the first observation has neither messages nor text")

    def next(self, obs: Observation) -> list[int]:
        """Token ids of a later observation, tokenized on its own (no bos)."""
        if obs.messages:
            text = self.delta(obs.messages) if self.chat else "\n" + _joined(obs.messages)
            return self.encode(text)
        return self.encode(obs.text or "")

    def encode(self, text: str, special: bool = False) -> list[int]:
        if not text:
            return []
        known = self._known.get((text, special))
        if known is not None:
            return list(known)
        if self._backend is not None:
            ids = list(self._backend.encode(text, add_special_tokens=special).ids)
        else:
            ids = list(self.tokenizer(text, add_special_tokens=special)["input_ids"])
        if len(self._known) < KNOWN_TEXTS:
            self._known[(text, special)] = ids
        return list(ids)

    def delta(self, messages: Sequence[dict[str, str]]) -> str:
        """Template text of `messages` after an assistant turn, generation prompt included."""
        prefix, cut = self._stand_in_cut()
        full = self.tokenizer.apply_chat_template(
            [*STAND_IN, *messages], add_generation_prompt=True, tokenize=False
        )
        if full[:cut] != prefix[:cut]:
            raise ValueError(
                "chat template: adding messages rewrites the turns before them, so it cannot be "
                "rendered turn by turn"
            )
        return full[cut:]

    def _stand_in_cut(self) -> tuple[str, int]:
        if self._cut is None:
            prefix = self.tokenizer.apply_chat_template(list(STAND_IN), tokenize=False)
            ends = [prefix.rfind(t) for t in self._stop_texts()]
            end = max(ends)
            if end < 0:
                raise ValueError(
                    "chat template: no end-of-turn token (the tokenizer's eos) after an "
                    "assistant message; set the tokenizer's eos_token to the template's"
                )
            token = self._stop_texts()[ends.index(end)]
            self._cut = (prefix, end + len(token))
        return self._cut

    def _stop_texts(self) -> list[str]:
        return [self.tokenizer.convert_ids_to_tokens(i) for i in self.stop_ids]


def _tools_text(tools: Sequence[dict[str, Any]]) -> str:
    """Tool schemas as plain text, for a tokenizer without a chat template to render them."""
    if not tools:
        return ""
    return "Tools (JSON schemas):\n" + "\n".join(json.dumps(t) for t in tools) + "\n"


def _joined(messages: Sequence[dict[str, str]]) -> str:
    return "\n".join(m["content"] for m in messages)
