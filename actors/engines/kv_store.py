"""KV caches kept between generate calls, so a multi-turn episode's context is computed once.

A multi-turn episode asks the engine for each turn with its whole context (prompt, earlier
turns, observations). Without a cache kept between calls every turn prefills all of it again;
with one, a turn prefills only what is new since the last (the last sampled token and the
environment's observation). A request names where its rows' caches go when they finish
(`GenerationRequest.cache_keys`, one per sample) and which cache it continues
(`resume_key`); the torch engine keeps them here:

```
  turn k:   prefill([cached KV of resume_key] + new tokens) -> decode -> rows finish
                                                                     |
            KvStore[cache_keys[i]] = (tokens whose KV is held, per-layer K/V)  <-+
  turn k+1: take(resume_key): used only if its tokens are a prefix of the new context and it
            was computed by the weights loaded now (new weights make every entry stale)
```

An entry is used once (taking it removes it); the oldest entries are evicted beyond
`max_entries`, and `release` drops the entries of episodes that ended.
"""

from __future__ import annotations

import collections
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch
from transformers import DynamicCache


@dataclass(frozen=True)
class KvEntry:
    """The KV cache of one sequence: its tokens and, per layer, keys and values [H, L, D]."""

    tokens: tuple[int, ...]
    layers: tuple[tuple[torch.Tensor, torch.Tensor], ...]
    version: int


class KvStore:
    """Per-sequence KV caches by key (see the module docstring)."""

    def __init__(self, max_entries: int = 4096) -> None:
        self.max_entries = max_entries
        self._entries: collections.OrderedDict[str, KvEntry] = collections.OrderedDict()
        self.hits = 0
        """Requests that continued a kept cache."""
        self.misses = 0
        """Requests that named a cache that was gone, stale or not a prefix of their context."""
        self.reused_tokens = 0
        """Prompt tokens not prefilled thanks to a kept cache."""

    def __len__(self) -> int:
        return len(self._entries)

    def take(self, key: str, prompt: Sequence[int], version: int) -> KvEntry | None:
        """The entry under `key` if it can continue `prompt` under weights `version` (it is
        removed either way)."""
        entry = self._entries.pop(key, None) if key else None
        if entry is None:
            self.misses += bool(key)
            return None
        n = len(entry.tokens)
        if entry.version != version or n >= len(prompt) or tuple(prompt[:n]) != entry.tokens:
            self.misses += 1
            return None
        self.hits += 1
        self.reused_tokens += n
        return entry

    def save(self, key: str, entry: KvEntry) -> None:
        self._entries.pop(key, None)
        self._entries[key] = entry
        while len(self._entries) > self.max_entries:
            self._entries.popitem(last=False)

    def release(self, keys: Iterable[str]) -> None:
        """Drop these entries (their sequences will not continue)."""
        for key in keys:
            self._entries.pop(key, None)

    def clear(self) -> None:
        """Drop everything (the weights changed)."""
        self._entries.clear()


def batched_cache(
    entries: Sequence[KvEntry | None], num_layers: int, config: object
) -> tuple[DynamicCache, torch.Tensor, list[int]]:
    """A DynamicCache holding each row's entry right-aligned (rows without one hold padding),
    its attention mask [R, C] and each row's cached length."""
    lengths = [len(e.tokens) if e is not None else 0 for e in entries]
    width = max(lengths)
    some = next(e for e in entries if e is not None)
    cache = DynamicCache(config=config)
    mask = torch.zeros((len(entries), width), dtype=torch.long, device=some.layers[0][0].device)
    for row, n in enumerate(lengths):
        mask[row, width - n :] = 1 if n else 0
    for layer in range(num_layers):
        k0, v0 = some.layers[layer]
        keys = k0.new_zeros((len(entries), k0.shape[0], width, k0.shape[2]))
        values = v0.new_zeros((len(entries), v0.shape[0], width, v0.shape[2]))
        for row, entry in enumerate(entries):
            if entry is not None:
                n = lengths[row]
                keys[row, :, width - n :] = entry.layers[layer][0]
                values[row, :, width - n :] = entry.layers[layer][1]
        cache.update(keys, values, layer)
    return cache, mask, lengths


def row_entry(
    cache: DynamicCache, row: int, mask_row: torch.Tensor, tokens: Sequence[int], version: int
) -> KvEntry:
    """Row `row` of a batched cache as an entry (padding columns removed)."""
    real = mask_row.bool()
    layers = tuple(
        (layer.keys[row][:, real].clone(), layer.values[row][:, real].clone())
        for layer in cache.layers
    )
    assert layers[0][0].shape[1] == len(tokens), (layers[0][0].shape, len(tokens))
    return KvEntry(tokens=tuple(int(t) for t in tokens), layers=layers, version=version)
