"""The hub inside the simulator: the real `replay` admission, buffer and prompt code, no sockets.

`SimHub` mirrors the handlers of `replay/server.py` that decide anything, calling the same
functions in the same order, so a change of the admission rule or of the buffer's staleness
policy changes the simulation too:

- `on_group`      = `Hub.on_group`: `ReplayBuffer.insert`; the credit is released; a group stale
                    on arrival is dropped and its prompt re-issued.
- `adopt_version` = `Hub.adopt_version`: `ReplayBuffer.drop_stale`, prompts re-issued.
- `grant`         = `Hub.grant_credits`: `replay.admission.credits_available` over the buffer's
                    counters, shared with `replay.admission.allocate` by free slots.
- `serve`         = `Hub.serve_parked`: `ReplayBuffer.sample` (all-or-nothing, η enforced).

The admission functions are looked up on the `replay.admission` module at call time, so a test
may wrap them. Groups are real `asyncrl.protocol.Group` objects: one built with `Group.build` per
policy version (tiny arrays, `group_size` samples) and reused with each group's own identity; their
lengths live in the simulator, which only needs them for timing.
"""

from __future__ import annotations

import collections
import dataclasses
import heapq
from typing import Any, Literal, NamedTuple

import numpy as np

from asyncrl.protocol import Group, Trajectory
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
        self.free = FreeSlots()
        self.in_flight = 0
        self.credit_serial = 0
        self.parked: collections.deque[int] = collections.deque()  # requests' num_groups
        self.num_dropped_stale = 0
        self._templates: dict[int, dict[str, Any]] = {}  # version -> Group fields

    @property
    def policy_version(self) -> int:
        return self.buffer.policy_version

    def register(self, actor_id: str, concurrency: int) -> None:
        """An actor's Hello: it can hold `concurrency` credits."""
        self.credits[actor_id] = {}
        self.concurrency[actor_id] = concurrency
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

    def grant(self) -> dict[str, list[Credit]]:
        """New credits per actor, as `Hub.grant_credits` issues them."""
        if not self.free:
            return {}
        total = admission.credits_available(
            policy_version=self.policy_version,
            max_staleness=self.max_staleness,
            groups_per_step=self.groups_per_step,
            consumed=self.buffer.num_consumed,
            ready=self.buffer.num_unsampled,
            in_flight=self.in_flight,
            stored=len(self.buffer),
            capacity=self.buffer.capacity,
            insert_room=self.buffer.insert_room(),
        )
        if total <= 0:
            return {}
        granted: dict[str, list[Credit]] = {}
        for actor_id, n in admission.allocate(total, self.free.candidates(total)).items():
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

    def make_group(self, actor_id: str, seq: int, credit: Credit, policy_version: int) -> Group:
        """A real Group for this credit, every sample stamped with `policy_version`."""
        fields = self._templates.get(policy_version)
        if fields is None:
            template = self._template(policy_version)
            fields = {f.name: getattr(template, f.name) for f in dataclasses.fields(Group)}
            self._templates[policy_version] = fields
        identity = {"group_id": f"{actor_id}/{seq}", "prompt_id": credit.prompt_id,
                    "credit_id": credit.credit_id, "actor_id": actor_id, "seq": seq}  # fmt: skip
        return Group(**(fields | identity))

    def _template(self, policy_version: int) -> Group:
        sample = Trajectory(
            tokens=np.zeros(2, np.int32),
            prompt_len=1,
            loss_mask=np.ones(1, np.uint8),
            behavior_logprobs=np.zeros(1, np.float32),
            reward=0.0,
            min_policy_version=policy_version,
            max_policy_version=policy_version,
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
    """Free credit slots per actor, and the actors `admission.allocate` would serve first.

    `allocate(total, free)` deals one credit per round to actors sorted by (most free slots,
    id). When `total` is below the number of actors with free slots, the first round alone
    spends it, so the result depends only on the first `total` actors in that order: passing
    just those gives the identical grant (a unit test checks this against the full map). That
    keeps a grant O(total log A) instead of O(A log A) with thousands of actors.
    """

    def __init__(self) -> None:
        self.slots: dict[str, int] = {}
        self._heap: list[tuple[int, str]] = []  # (-slots, actor_id), stale entries skipped

    def __bool__(self) -> bool:
        return bool(self.slots)

    def add(self, actor_id: str, delta: int) -> None:
        n = self.slots.get(actor_id, 0) + delta
        assert n >= 0, f"{actor_id} would hold more credits than its concurrency"
        if n == 0:
            self.slots.pop(actor_id, None)
            return
        self.slots[actor_id] = n
        heapq.heappush(self._heap, (-n, actor_id))
        if len(self._heap) > 4 * len(self.slots) + 64:
            self._heap = [(-k, a) for a, k in self.slots.items()]
            heapq.heapify(self._heap)

    def candidates(self, total: int) -> dict[str, int]:
        """Free slots of the actors that can receive any of `total` credits."""
        if total >= len(self.slots):
            return dict(self.slots)
        chosen: dict[str, int] = {}
        while len(chosen) < total:
            neg, actor_id = heapq.heappop(self._heap)
            if self.slots.get(actor_id) == -neg and actor_id not in chosen:
                chosen[actor_id] = -neg
        for actor_id, n in chosen.items():
            heapq.heappush(self._heap, (-n, actor_id))
        return chosen
