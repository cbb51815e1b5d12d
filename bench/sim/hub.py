"""The hub inside the simulator: the real `replay` admission, buffer and prompt code, no sockets.

`SimHub` mirrors the handlers of `replay/server.py` that decide anything, calling the same
functions in the same order, so a change of the admission rule or of the buffer's staleness
policy changes the simulation too:

- `on_group`       = `Hub.on_group`: `ReplayBuffer.insert`; the credit is released; a group
                     stale on arrival is dropped and its prompt re-issued.
- `adopt_version`  = `Hub.adopt_version`: `ReplayBuffer.drop_stale`, prompts re-issued.
- `weights_loaded` = `Hub.on_weights_loaded`: the newest version an actor reported loading.
- `grant`          = `Hub.grant_credits` (`replay.admission.grant`): each actor's credits are
                     capped by `replay.admission.room`, the AReaL window over the buffer's
                     counters at the version the actor will generate with
                     (`replay.admission.generation_version`), and dealt by free slots with
                     `replay.admission.allocate`, actors with the largest cap first.
- `serve`          = `Hub.serve_parked`: `ReplayBuffer.sample` (all-or-nothing, η enforced).

So an actor still holding weights w while the learner is at v > w gets credits only while the
window at w has room: a group it generates is stamped w and must be consumed by version w + η.

The admission functions are looked up on the `replay.admission` module at call time, so a test
may wrap them. `grant` asks `room` once per distinct actor version and hands `allocate` only the
actors that can receive a credit (`FreeSlots`), the identical grant in O(total log A) with
thousands of actors. Groups are real `asyncrl.protocol.Group` objects: one built with
`Group.build` per policy version (tiny arrays, `group_size` samples) and reused with each group's
own identity; their lengths live in the simulator, which only needs them for timing.
"""

from __future__ import annotations

import collections
import dataclasses
import heapq
from collections.abc import Callable
from typing import Any, Literal, NamedTuple

import numpy as np

from asyncrl.protocol.messages import Group, Trajectory
from replay import admission
from replay.buffer import InsertResult, ReplayBuffer
from replay.prompts import Prompt, PromptSource


class Credit(NamedTuple):
    """One credit as the actor sees it (`CreditItem` plus the `Credits` message's version)."""

    credit_id: int
    prompt_id: str
    policy_version: int  # the hub's version when it issued the credit


class SimHub:
    """Credits, storage, staleness and batches of one hub, driven by simulated messages."""

    def __init__(
        self,
        *,
        max_staleness: int,
        groups_per_step: int,
        group_size: int,
        capacity: int,
        sampling: Literal["fifo", "freshest"] = "fifo",
        num_prompts: int = 16384,
        seed: int = 0,
    ) -> None:
        self.max_staleness = max_staleness
        self.groups_per_step = groups_per_step
        self.group_size = group_size
        self.buffer = ReplayBuffer(
            capacity=capacity,
            max_staleness=max_staleness,
            batch_groups=groups_per_step,
            sampling=sampling,
        )
        self.prompts = PromptSource([Prompt(f"p{i}", "") for i in range(num_prompts)], seed=seed)
        self.credits: dict[str, dict[int, str]] = {}  # actor -> credit_id -> prompt_id
        self.concurrency: dict[str, int] = {}
        self.loaded: dict[str, int] = {}  # actor -> version reported in WeightsLoaded
        self.free = FreeSlots()
        self.in_flight = 0
        self.credit_serial = 0
        self.parked: collections.deque[int] = collections.deque()  # requests' num_groups
        self.num_dropped_stale = 0
        self._templates: dict[tuple[int, int], dict[str, Any]] = {}  # (min, max) -> fields

    @property
    def policy_version(self) -> int:
        return self.buffer.policy_version

    def register(self, actor_id: str, concurrency: int) -> None:
        """An actor's Hello: it can hold `concurrency` credits."""
        self.credits[actor_id] = {}
        self.concurrency[actor_id] = concurrency
        self.loaded[actor_id] = -1  # nothing reported: the initial weights
        self.free.add(actor_id, concurrency)

    # --- the handlers of replay/server.py -------------------------------------------------------

    def on_group(self, group: Group) -> None:
        """Store a pushed group and release its credit."""
        result = self.buffer.insert(group)
        assert result is not InsertResult.FULL, "admission let more groups out than capacity"
        assert result is not InsertResult.DUPLICATE, "the simulator never resends"
        del self.credits[group.actor_id][group.credit_id]
        self.in_flight -= 1
        self.free.add(group.actor_id, 1)
        if result is InsertResult.STALE:
            self._dropped([group])

    def adopt_version(self, policy_version: int) -> None:
        """The learner reported a new version: drop what became too stale."""
        if policy_version > self.policy_version:
            self._dropped(self.buffer.drop_stale(policy_version))

    def park(self, policy_version: int, num_groups: int) -> None:
        """A SampleRequest: adopt its version, wait until enough eligible groups exist."""
        self.adopt_version(policy_version)
        self.parked.append(num_groups)

    def weights_loaded(self, actor_id: str, policy_version: int) -> None:
        """A WeightsLoaded: the actor generates with `policy_version` from now on.

        Weights are published only after the hub adopted their version, so the generation
        version (never above the hub's) is the reported one and stays so as the hub's grows.
        """
        assert policy_version <= self.policy_version, "weights newer than the hub's version"
        self.loaded[actor_id] = max(self.loaded[actor_id], policy_version)
        version = admission.generation_version(self.policy_version, self.loaded[actor_id])
        self.free.move(actor_id, version)

    def grant(self) -> dict[str, list[Credit]]:
        """New credits per actor, as `Hub.grant_credits` issues them."""

        def room(policy_version: int) -> int:
            return admission.room(
                self.buffer,
                self.in_flight,
                self.max_staleness,
                self.groups_per_step,
                policy_version,
            )

        granted: dict[str, list[Credit]] = {}
        for actor_id, n in self.free.grant(room).items():
            granted[actor_id] = [self._new_credit(actor_id) for _ in range(n)]
            self.free.add(actor_id, -n)
        return granted

    def serve(self) -> list[Group] | None:
        """The oldest parked request's batch, or None while too few eligible groups exist."""
        if not self.parked:
            return None
        groups, dropped = self.buffer.sample(self.policy_version, self.parked[0])
        self._dropped(dropped)
        if not groups:
            return None
        self.parked.popleft()
        return groups

    # --- helpers --------------------------------------------------------------------------------

    def _new_credit(self, actor_id: str) -> Credit:
        prompt, _seed = self.prompts.next_prompt()
        self.credit_serial += 1
        self.credits[actor_id][self.credit_serial] = prompt.prompt_id
        self.in_flight += 1
        return Credit(self.credit_serial, prompt.prompt_id, self.policy_version)

    def _dropped(self, groups: list[Group]) -> None:
        for group in groups:
            self.prompts.reissue(group.prompt_id)
        self.num_dropped_stale += len(groups)

    def make_group(
        self,
        actor_id: str,
        seq: int,
        credit: Credit,
        policy_version: int,
        max_version: int | None = None,
    ) -> Group:
        """A real Group for this credit, every sample's tokens made by `policy_version` (the
        oldest, which staleness counts from) up to `max_version` (default: the same)."""
        versions = (policy_version, policy_version if max_version is None else max_version)
        fields = self._templates.get(versions)
        if fields is None:
            template = self._template(*versions)
            fields = {f.name: getattr(template, f.name) for f in dataclasses.fields(Group)}
            self._templates[versions] = fields
        identity = {
            "group_id": f"{actor_id}/{seq}",
            "prompt_id": credit.prompt_id,
            "credit_id": credit.credit_id,
            "actor_id": actor_id,
            "seq": seq,
        }
        return Group(**(fields | identity))

    def _template(self, policy_version: int, max_version: int) -> Group:
        sample = Trajectory(
            tokens=np.zeros(2, np.int32),
            prompt_len=1,
            loss_mask=np.ones(1, np.uint8),
            behavior_logprobs=np.zeros(1, np.float32),
            reward=0.0,
            min_policy_version=policy_version,
            max_policy_version=max_version,
            finish_reason="stop",
        )
        return Group.build(
            group_id="template",
            prompt_id="template",
            credit_id=0,
            actor_id="template",
            seq=0,
            trajectories=[sample] * self.group_size,
        )


class FreeSlots:
    """Free credit slots per actor, grouped by the version each actor generates with.

    `admission.grant` caps each actor by the room at its version, `total` = the largest cap, and
    `admission.allocate` deals one credit per round to actors sorted by (largest cap, most free
    slots, id), never past an actor's cap. So the first round decides who takes part: only the
    first `total` actors in that order can receive anything, and passing just those gives the
    identical grant (a unit test checks this against `admission.grant` over the full map).

    The room is monotone in the version but may be equal at several versions (the capacity
    binds), and then actors of those versions interleave by (slots, id). So each version keeps
    its own heap of (-slots, id), and `candidates` merges the heaps of equal cap, largest cap
    first: O(total log A) per grant instead of O(A log A) with thousands of actors.
    """

    def __init__(self) -> None:
        self.slots: dict[str, int] = {}  # actors with free slots
        self.version: dict[str, int] = {}  # generation version; absent = 0 (initial weights)
        self._heaps: dict[int, list[tuple[int, str]]] = {}  # (-slots, id), stale entries skipped
        self._num_free: dict[int, int] = {}  # version -> actors with free slots at it

    def __bool__(self) -> bool:
        return bool(self.slots)

    def add(self, actor_id: str, delta: int) -> None:
        old = self.slots.get(actor_id, 0)
        n = old + delta
        assert n >= 0, f"{actor_id} would hold more credits than its concurrency"
        version = self.version.get(actor_id, 0)
        if n == 0:
            if old:
                del self.slots[actor_id]
                self._count(version, -1)
            return
        if not old:
            self._count(version, +1)
        self.slots[actor_id] = n
        self._push(version, n, actor_id)

    def move(self, actor_id: str, version: int) -> None:
        """The actor now generates with `version`."""
        old = self.version.get(actor_id, 0)
        if version == old:
            return
        self.version[actor_id] = version
        n = self.slots.get(actor_id, 0)
        if n:
            self._count(old, -1)
            self._count(version, +1)
            self._push(version, n, actor_id)

    def grant(self, room: Callable[[int], int]) -> dict[str, int]:
        """`admission.grant` for these actors, `room(u)` being the admission room at version u."""
        rooms = {version: room(version) for version in self._num_free}
        total = max(rooms.values(), default=0)
        if total <= 0:
            return {}
        chosen = self.candidates(total, rooms)
        caps = {actor_id: rooms[self.version.get(actor_id, 0)] for actor_id in chosen}
        return admission.allocate(total, chosen, caps)

    def candidates(self, total: int, rooms: dict[int, int]) -> dict[str, int]:
        """Free slots of the first `total` actors in `allocate`'s order, with cap = rooms[version]
        (actors whose cap is not positive get nothing and are left out)."""
        if total >= len(self.slots):
            return dict(self.slots)
        by_cap: dict[int, list[int]] = collections.defaultdict(list)
        for version, cap in rooms.items():
            by_cap[cap].append(version)
        chosen: dict[str, int] = {}
        for cap in sorted(by_cap, reverse=True):
            if cap <= 0 or len(chosen) >= total:
                break
            heads: list[tuple[int, str, int]] = []  # the best live entry of each version's heap
            for version in by_cap[cap]:
                self._next(version, heads, chosen)
            while heads and len(chosen) < total:
                neg, actor_id, version = heapq.heappop(heads)
                chosen[actor_id] = -neg
                self._next(version, heads, chosen)
            for neg, actor_id, version in heads:
                heapq.heappush(self._heaps[version], (neg, actor_id))
        for actor_id, n in chosen.items():
            heapq.heappush(self._heaps[self.version.get(actor_id, 0)], (-n, actor_id))
        return chosen

    def _next(
        self, version: int, heads: list[tuple[int, str, int]], chosen: dict[str, int]
    ) -> None:
        """Move the best live entry of `version`'s heap into `heads` (stale ones are dropped)."""
        heap = self._heaps[version]
        while heap:
            neg, actor_id = heapq.heappop(heap)
            if actor_id not in chosen and self._live(version, neg, actor_id):
                heapq.heappush(heads, (neg, actor_id, version))
                return

    def _live(self, version: int, neg: int, actor_id: str) -> bool:
        return self.version.get(actor_id, 0) == version and self.slots.get(actor_id) == -neg

    def _count(self, version: int, delta: int) -> None:
        n = self._num_free.get(version, 0) + delta
        if n:
            self._num_free[version] = n
        else:  # no actor left at this version: all its heap entries are stale
            del self._num_free[version]
            self._heaps.pop(version, None)

    def _push(self, version: int, n: int, actor_id: str) -> None:
        heap = self._heaps.setdefault(version, [])
        heapq.heappush(heap, (-n, actor_id))
        if len(heap) > 4 * self._num_free[version] + 64:
            heap[:] = sorted({entry for entry in heap if self._live(version, *entry)})
