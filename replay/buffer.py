"""The replay buffer: stored groups, the staleness bound, sampling order, reuse and its limiter.

A pure data structure: no sockets, no clock, no threads. The unit of storage and sampling is a
whole `Group` (all samples of one prompt). Invariants (pinned by tests/unit/test_buffer.py):

- Staleness: at policy version v a group is eligible iff v - group.min_policy_version <= η
  (`max_staleness`). Versions only move forward, so a group that is stale stays stale: it is
  dropped (never handed out), counted, and returned to the caller so its prompt is re-issued.
  The buffer never holds a group that is stale at its current version.
- Nothing is lost or duplicated: every inserted group ends exactly once as exhausted (sampled
  `max_times_sampled` times, or evicted after at least one sample), dropped stale, or still
  stored. A repeat of a stored (actor_id,
  seq) is reported as a duplicate and not stored again.
- Capacity is a hard limit: an insert into a full buffer retires the oldest group that was
  already handed out at least once (only possible with reuse, `max_times_sampled` > 1); if every
  stored group is still unsampled, the insert is refused (`InsertResult.FULL`). A group the
  learner has not seen is never evicted.
- `sample` is all-or-nothing: exactly `num_groups` distinct groups, or none (the caller parks
  the request until enough are eligible).

Order: `fifo` takes the oldest inserted first; `freshest` takes the highest
`min_policy_version` first (oldest inserted first among equals).

Durability (replay/durability.py): an insert may carry the log position (`lsn`) of its
write-ahead record; `sample(..., durable_lsn=...)` hands out only groups whose record is on disk,
so a crash can never lose a group the learner already trained on. `take` replays a recorded
hand-out; `give_back` undoes the hand-outs of a batch the learner never trained on (it died):
those groups are eligible again, ahead of every other; `rewind` moves the version back (a
learner resumed from an older checkpoint); `export`/`restore` carry the whole state through a
snapshot.

Reuse limiter (Reverb's SampleToInsertRatio, in groups): with `samples_per_insert` = r > 0 the
buffer tracks diff = r * inserted - sampled. A batch of n may be sampled only while
diff - n >= -T, and `insert_room()` (which the hub's credits honour) allows inserts only while
diff + r <= T, with T = `tolerance`. A group that leaves by staleness before its r samples settles
its account (counted as sampled r times), so drops cannot wedge the limiter. The constructor
refuses settings that could deadlock: r > max_times_sampled (diff would grow without bound),
T < r * n (inserts would stop before one batch is stored), and 2T < n + r (both sides blocked).
A full buffer ignores the limiter for sampling (it cannot take inserts, so waiting for them
would wait forever). With those rules, whenever a batch cannot be sampled an insert is allowed.
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass
from typing import Literal

from asyncrl.protocol.messages import Group


class InsertResult(enum.Enum):
    STORED = "stored"
    DUPLICATE = "duplicate"
    STALE = "stale"  # already too stale on arrival: not stored, its prompt should be re-issued
    FULL = "full"


@dataclass(eq=False)
class _Entry:
    key: tuple[str, int]
    group: Group
    min_version: int
    times_sampled: int = 0
    lsn: int = 0  # log position of its write-ahead record (0: nothing to wait for)


class ReplayBuffer:
    """Groups waiting for the learner, keyed by (actor_id, seq)."""

    def __init__(
        self,
        *,
        capacity: int,
        max_staleness: int,
        batch_groups: int,
        sampling: Literal["fifo", "freshest"] = "fifo",
        max_times_sampled: int = 1,
        samples_per_insert: float = 0.0,
        tolerance: float = 64.0,
    ) -> None:
        if capacity < batch_groups:
            raise ValueError(
                f"replay.capacity_groups: must hold one batch ({batch_groups}), got {capacity}"
            )
        if sampling not in ("fifo", "freshest"):
            raise ValueError(f"replay.sampling: must be 'fifo' or 'freshest', got {sampling!r}")
        _check_limiter(samples_per_insert, tolerance, batch_groups, max_times_sampled)
        self.capacity = capacity
        self.max_staleness = max_staleness
        self.batch_groups = batch_groups
        self.sampling = sampling
        self.max_times_sampled = max_times_sampled
        self.samples_per_insert = samples_per_insert
        self.tolerance = tolerance
        self.policy_version = 0
        self._entries: dict[tuple[str, int], _Entry] = {}  # insertion order = FIFO order
        self._by_version: dict[int, dict[tuple[str, int], _Entry]] = {}
        self._limiter_diff = 0.0
        self.num_inserted = 0
        self.num_sampled = 0  # hand-outs (a group sampled twice counts twice)
        self.num_consumed = 0  # distinct groups handed out at least once
        self.num_unsampled = 0  # stored groups never handed out yet
        self.num_dropped_stale = 0
        self.num_duplicates = 0
        self.num_evicted = 0  # sampled at least once, retired early to make room for an insert

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: tuple[str, int]) -> bool:
        return key in self._entries

    # --- insert ---------------------------------------------------------------------------------

    def insert(self, group: Group, lsn: int = 0) -> InsertResult:
        """Store a group unless it is a duplicate, already stale, or the buffer is full; it is
        handed out only once `lsn` (its write-ahead record, 0 = none) is durable."""
        key = (group.actor_id, group.seq)
        if key in self._entries:
            self.num_duplicates += 1
            return InsertResult.DUPLICATE
        min_version = group.min_policy_version
        if self._is_stale(min_version, self.policy_version):
            self.num_dropped_stale += 1
            return InsertResult.STALE
        if len(self._entries) >= self.capacity and not self._evict_one_sampled():
            return InsertResult.FULL
        entry = _Entry(key, group, min_version, lsn=lsn)
        self._entries[key] = entry
        self._by_version.setdefault(min_version, {})[key] = entry
        self.num_inserted += 1
        self.num_unsampled += 1
        self._limiter_diff += self.samples_per_insert
        return InsertResult.STORED

    def has_room(self, group: Group) -> bool:
        """Whether `insert(group)` would not answer FULL (a stale group needs no room)."""
        if len(self._entries) < self.capacity:
            return True
        stale = self._is_stale(group.min_policy_version, self.policy_version)
        return stale or any(e.times_sampled > 0 for e in self._entries.values())

    def insert_room(self) -> int:
        """Inserts the reuse limiter allows now (capacity aside); large when it is off."""
        if self.samples_per_insert <= 0:
            return self.capacity
        room = (self.tolerance - self._limiter_diff) / self.samples_per_insert
        return max(0, math.floor(room + 1e-9))

    # --- staleness ------------------------------------------------------------------------------

    def _is_stale(self, min_version: int, policy_version: int) -> bool:
        return policy_version - min_version > self.max_staleness

    def drop_stale(self, policy_version: int) -> list[Group]:
        """Adopt `policy_version` (only forward) and drop every group now too stale."""
        if policy_version <= self.policy_version:
            return []
        self.policy_version = policy_version
        cutoff = policy_version - self.max_staleness  # eligible iff min_version >= cutoff
        dropped: list[Group] = []
        for version in sorted(v for v in self._by_version if v < cutoff):
            for entry in self._by_version.pop(version).values():
                del self._entries[entry.key]
                self._settle(entry)
                dropped.append(entry.group)
        self.num_dropped_stale += len(dropped)
        return dropped

    # --- sample ---------------------------------------------------------------------------------

    def can_sample(self, num_groups: int) -> bool:
        """Whether `sample(num_groups)` at the current version would return a batch."""
        if len(self._entries) < num_groups:
            return False
        if self.samples_per_insert <= 0 or len(self._entries) >= self.capacity:
            return True  # a full buffer cannot take inserts: the limiter must not block samples
        return self._limiter_diff - num_groups >= -self.tolerance

    def sample(
        self, policy_version: int, num_groups: int, durable_lsn: float = math.inf
    ) -> tuple[list[Group], list[Group]]:
        """(exactly num_groups eligible groups or [], groups dropped as stale on the way);
        only groups whose record is durable (lsn <= durable_lsn) are eligible."""
        assert num_groups >= 1
        dropped = self.drop_stale(policy_version)
        if not self.can_sample(num_groups):
            return [], dropped
        chosen = self._choose(num_groups, durable_lsn)
        if chosen is None:
            return [], dropped
        self._hand_out(chosen)
        return [entry.group for entry in chosen], dropped

    def take(self, keys: list[tuple[str, int]]) -> list[Group]:
        """Hand out exactly these stored groups, as `sample` did (replaying a recorded batch)."""
        chosen = [self._entries[key] for key in keys]
        self._hand_out(chosen)
        return [entry.group for entry in chosen]

    def _hand_out(self, chosen: list[_Entry]) -> None:
        num_groups = len(chosen)
        for entry in chosen:
            if entry.times_sampled == 0:
                self.num_consumed += 1
                self.num_unsampled -= 1
            entry.times_sampled += 1
            if entry.times_sampled >= self.max_times_sampled:
                self._remove(entry)
        self.num_sampled += num_groups
        self._limiter_diff -= num_groups

    def _choose(self, num_groups: int, durable_lsn: float) -> list[_Entry] | None:
        """The groups a batch takes, or None while too few of them are durable."""
        if self.sampling == "fifo":
            it = iter(self._entries.values())
            chosen = [next(it) for _ in range(num_groups)]
            return chosen if chosen[-1].lsn <= durable_lsn else None  # lsn grows in FIFO order
        chosen = []
        for version in sorted(self._by_version, reverse=True):
            for entry in self._by_version[version].values():
                if entry.lsn <= durable_lsn:
                    chosen.append(entry)
                if len(chosen) == num_groups:
                    return chosen
        return None

    # --- a learner that died, a learner that went back --------------------------------------

    def give_back(self, groups: list[Group]) -> list[Group]:
        """Undo one hand-out of each group (its batch was never trained on): eligible again,
        ahead of every other group. Returns those already too stale, dropped instead."""
        returned: dict[tuple[str, int], _Entry] = {}
        dropped: list[Group] = []
        for group in groups:
            key = (group.actor_id, group.seq)
            entry = self._entries.pop(key, None)
            if entry is None:  # its last hand-out retired it: bring it back
                entry = _Entry(key, group, group.min_policy_version, self.max_times_sampled)
            entry.times_sampled -= 1
            if entry.times_sampled == 0:
                self.num_consumed -= 1
                self.num_unsampled += 1
            self.num_sampled -= 1
            self._limiter_diff += 1
            if self._is_stale(entry.min_version, self.policy_version):
                self._settle(entry)
                self.num_dropped_stale += 1
                dropped.append(group)
            else:
                returned[key] = entry
        self._entries = {**returned, **self._entries}
        self._reindex()
        return dropped

    def rewind(self, policy_version: int, consumed_at_most: int) -> None:
        """Go back to an older `policy_version` (the learner resumed from a checkpoint): its
        steps since then are lost, so admission counts at most `consumed_at_most` groups as
        consumed (the batches of the steps it still has)."""
        assert 0 <= policy_version <= self.policy_version
        self.policy_version = policy_version
        self.num_consumed = min(self.num_consumed, consumed_at_most)

    def _reindex(self) -> None:
        self._by_version = {}
        for key, entry in self._entries.items():
            self._by_version.setdefault(entry.min_version, {})[key] = entry

    def _remove(self, entry: _Entry) -> None:
        del self._entries[entry.key]
        bucket = self._by_version[entry.min_version]
        del bucket[entry.key]
        if not bucket:
            del self._by_version[entry.min_version]

    def _evict_one_sampled(self) -> bool:
        """Make room by retiring the oldest group the learner has already had (reuse only)."""
        for entry in self._entries.values():
            if entry.times_sampled > 0:
                self._remove(entry)
                self._settle(entry)
                self.num_evicted += 1
                return True
        return False

    def _settle(self, entry: _Entry) -> None:
        """A group leaving early (stale, evicted): count its missing samples so the limiter
        stays live."""
        if entry.times_sampled == 0:
            self.num_unsampled -= 1
        self._limiter_diff -= max(0.0, self.samples_per_insert - entry.times_sampled)

    def stored_groups(self) -> list[Group]:
        """Every stored group, in insertion order (for stats and tests)."""
        return [entry.group for entry in self._entries.values()]

    # --- snapshot -------------------------------------------------------------------------------

    _COUNTS = (
        "policy_version",
        "_limiter_diff",
        "num_inserted",
        "num_sampled",
        "num_consumed",
        "num_unsampled",
        "num_dropped_stale",
        "num_duplicates",
        "num_evicted",
    )

    def export(self) -> tuple[dict[str, float], list[tuple[Group, int]]]:
        """(counters, [(group, times_sampled)] in order): everything `restore` needs."""
        counts = {name: getattr(self, name) for name in self._COUNTS}
        return counts, [(e.group, e.times_sampled) for e in self._entries.values()]

    def restore(self, counts: dict[str, float], entries: list[tuple[Group, int]]) -> None:
        """The state `export` returned (into an empty buffer); every group is durable."""
        assert not self._entries, "restore into an empty buffer"
        for name in self._COUNTS:
            setattr(self, name, type(getattr(self, name))(counts[name]))
        for group, times_sampled in entries:
            key = (group.actor_id, group.seq)
            self._entries[key] = _Entry(key, group, group.min_policy_version, times_sampled)
        self._reindex()


def _check_limiter(rate: float, tolerance: float, batch: int, max_times_sampled: int) -> None:
    """Refuse limiter settings under which inserts and samples could both block forever."""
    if rate <= 0:
        return
    if rate > max_times_sampled:
        raise ValueError(
            f"replay.samples_per_insert: {rate} exceeds replay.max_times_sampled={max_times_sampled}; "
            "groups would leave before their samples and the limiter would stop all inserts"
        )
    need = max(rate * batch, (batch + rate) / 2)
    if tolerance < need:
        raise ValueError(
            f"replay.samples_per_insert_tolerance: {tolerance} could deadlock with batches of "
            f"{batch} groups at samples_per_insert={rate}; needs >= {need:g}"
        )
