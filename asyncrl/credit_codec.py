"""The compiled fast path for `Credits`, the message an actor decodes most: one item for every
group it will push, so decoding them generically (a Python check per field of every item)
would cost the actor more than encoding the group it pushes for that credit.

`decode_credits` takes a Credits header exactly as `encode` writes it (the known keys only, no
array frames): msgspec parses and type-checks it into typed structs, `info` (the one free-form
map) is decoded by msgpack as the generic path decodes it. Anything unusual (an unknown key, a
wrong type, a frame too many) answers None and the caller takes the generic path of
asyncrl/protocol.py, which names what is wrong; so the fast path never accepts what the generic
path refuses (tests/unit/test_protocol_fast_path.py pins it).
"""

from __future__ import annotations

import dataclasses

import msgspec

from asyncrl.group_codec import new_message, raw_map
from asyncrl.messages import PROTOCOL_VERSION, CreditItem, Credits

_EMPTY_MAP = b"\x80"  # msgpack's empty map: `info` as nearly every credit has it


class _Item(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    credit_id: int
    prompt_id: str
    prompt: str
    seed: int
    info: msgspec.Raw = msgspec.Raw(_EMPTY_MAP)


class _Credits(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    group_size: int
    policy_version: int
    items: list[_Item]
    type: str = ""
    protocol: int = 0


for _cls, _struct in ((CreditItem, _Item), (Credits, _Credits)):  # a field added there, add here
    _names = [f.name for f in dataclasses.fields(_cls)]
    assert list(_struct.__struct_fields__[: len(_names)]) == _names, f"{_cls.__name__}: {_names}"

_DECODE = msgspec.msgpack.Decoder(_Credits).decode
_asdict = msgspec.structs.asdict
_PARSE_ERRORS = (msgspec.ValidationError, msgspec.DecodeError)


def decode_credits(bufs: list[memoryview]) -> Credits | None:
    """The Credits message in `bufs` (its header alone), or None when anything about it is
    unusual (the generic decoder then decides)."""
    if len(bufs) != 1:
        return None
    try:
        c = _DECODE(bufs[0])
    except _PARSE_ERRORS:
        return None
    if c.type != "Credits" or c.protocol != PROTOCOL_VERSION:
        return None
    items = []
    for item in c.items:
        fields = _asdict(item)  # CreditItem's fields in order
        if bytes(item.info) == _EMPTY_MAP:
            fields["info"] = {}
        elif (info := raw_map(item.info)) is not None:
            fields["info"] = info
        else:
            return None
        items.append(new_message(CreditItem, fields))
    fields = {"group_size": c.group_size, "policy_version": c.policy_version, "items": tuple(items)}
    return new_message(Credits, fields)
