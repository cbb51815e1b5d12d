"""The one rule every config section states its limits with: `require` raises a `ValueError`
naming the key (``replay.max_staleness: must be >= 0, got -1``); `name_value_pairs` parses the
"name=value, ..." strings some keys take."""

from __future__ import annotations


def require(ok: bool, key: str, rule: str, value: object) -> None:
    if not ok:
        raise ValueError(f"{key}: {rule}, got {value!r}")


def name_value_pairs(text: str, key: str) -> list[tuple[str, str]]:
    """ "a=1, b=2" -> [("a", "1"), ("b", "2")]; ValueError naming `key` when malformed."""
    out = []
    for part in filter(None, (p.strip() for p in text.split(","))):
        name, sep, value = part.partition("=")
        require(
            bool(sep and name.strip() and value.strip()), key, 'expected "name=value, ..."', part
        )
        out.append((name.strip(), value.strip()))
    names = [n for n, _ in out]
    require(len(set(names)) == len(names), key, "names a component twice", text)
    return out
