"""Frame packing: the buffers of a `Batch` in one frame instead of four per group.

ZeroMQ moves every frame of a multipart message as a message of its own, and both sides pay
for each: the sending I/O thread writes each large frame with system calls of its own, the
receiving one reads it so, and the receiving Python code makes a `zmq.Frame` and a memoryview
of it (bench/zmq_framing.py: four frames per 32 KB group cost the sender 1.7x and the receiver
1.5x the CPU of one frame). A `Batch` of 64 groups of 32 KB is 257 frames.

So a sender may pack frames 1..n of a Batch into one: the buffers back to back, each starting
at the next multiple of `ALIGN` bytes (arrays stay aligned), their sizes listed in the header
under `"packed"`. The receiver restores frames 1..n as memoryviews of the frame it got before
it decodes anything else, so a packed Batch decodes exactly as the unpacked one (the arrays
of its groups are views of that frame, which lives as long as one of them does).

Packing costs a copy of the batch's bytes, which pays while frames are small: the hub packs a
Batch when its frames average fewer than `replay.pack_frames_below` bytes (bench/transport.py
`--variants hub,hub_unpacked` measures both ways side by side). Only a Batch is packed: groups
travel as the actor framed them, so the hub can forward and log the frames it received.
"""

from __future__ import annotations

from typing import Any

from asyncrl.messages import ProtocolError

ALIGN = 8
PACKED = "packed"  # the header key
_PAD = [b"\0" * (-r % ALIGN) for r in range(ALIGN)]


def pack(frames: list[Any], below: int) -> tuple[list[int], bytes] | None:
    """(sizes, body) for frames[1:] packed into one, or None when there is nothing to gain:
    fewer than two buffers, or buffers of `below` bytes or more on average."""
    bufs = frames[1:]
    if len(bufs) < 2:
        return None
    sizes = [memoryview(b).nbytes for b in bufs]
    if sum(sizes) >= below * len(sizes):
        return None
    parts: list[Any] = []
    for buf, size in zip(bufs, sizes, strict=True):
        parts.append(buf)
        if size % ALIGN:
            parts.append(_PAD[size % ALIGN])
    if parts[-1] is not bufs[-1]:
        parts.pop()  # no padding after the last buffer
    return sizes, b"".join(parts)


def unpack(sizes: Any, bufs: list[memoryview]) -> list[memoryview]:
    """The frames of a packed message, [header, buffer 1, ..., buffer n], from [header, body];
    raises ProtocolError naming `packed` when the sizes do not describe the body."""
    if type(sizes) is not list or not sizes or not all(type(n) is int and n >= 0 for n in sizes):
        raise ProtocolError(PACKED, "must be a non-empty list of buffer sizes (integers >= 0)")
    if len(bufs) != 2:
        raise ProtocolError(
            PACKED, f"a packed message has one frame after its header, got {len(bufs) - 1}"
        )
    body, out, pos = bufs[1], [bufs[0]], 0
    for size in sizes:
        pos += -pos % ALIGN
        out.append(body[pos : pos + size])
        pos += size
    if pos != body.nbytes:
        raise ProtocolError(
            PACKED, f"sizes need {pos} bytes, the frame holds {body.nbytes}", "truncated"
        )
    return out
