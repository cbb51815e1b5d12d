"""The reward-model server's queue: batches, length buckets, the bound, deadlines."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from actors.rewards.score_queue import Overloaded, PendingRequest, ScoreQueue, bucket_around

FAR = 1e9  # a deadline that never passes


def request(
    n: int, arrival_s: float = 0.0, deadline_s: float = FAR, rid: int = 0
) -> PendingRequest:
    return PendingRequest(b"peer", rid, n, arrival_s, deadline_s)


def tokens(*lengths: int) -> list[list[int]]:
    return [[7] * n for n in lengths]


def test_a_full_batch_is_due_at_once_and_a_partial_one_waits() -> None:
    q = ScoreQueue(max_batch=4, max_wait_s=FAR, max_samples=16)
    q.add(request(3, arrival_s=0.0), tokens(1, 2, 3))
    assert q.take(timeout_s=0.0) == []  # 3 < max_batch and the wait is far off
    q.add(request(2, arrival_s=0.0), tokens(4, 5))
    assert len(q.take(timeout_s=0.0)) == 4
    assert q.depth() == 1


def test_without_wait_a_partial_batch_runs() -> None:
    q = ScoreQueue(max_batch=8, max_wait_s=0.0, max_samples=16)
    q.add(request(2), tokens(3, 4))
    assert [len(s.tokens) for s in q.take(timeout_s=0.0)] == [3, 4]


def test_the_bound_refuses_a_request_whole() -> None:
    q = ScoreQueue(max_batch=2, max_wait_s=FAR, max_samples=4)
    q.add(request(3), tokens(1, 1, 1))
    with pytest.raises(Overloaded, match="3 of 4"):
        q.add(request(2), tokens(1, 1))
    assert q.depth() == 3
    q.add(request(1), tokens(1))
    assert q.depth() == 4


def test_scores_complete_requests_in_order() -> None:
    q = ScoreQueue(max_batch=4, max_wait_s=0.0, max_samples=16)
    a, b = request(2, rid=1), request(2, rid=2)
    q.add(a, tokens(5, 1))
    q.add(b, tokens(5, 1))
    batch = q.take(timeout_s=0.0)
    q.complete(batch, np.array([10 * s.request.request_id + s.index for s in batch]), 0.5)
    assert q.finished() == [a, b]  # both finish in the one batch
    assert q.finished() == []
    assert a.scores.tolist() == [10, 11] and b.scores.tolist() == [20, 21]
    assert a.compute_s == 0.5


def test_a_late_request_fails_whole_and_its_scores_are_discarded() -> None:
    q = ScoreQueue(max_batch=2, max_wait_s=FAR, max_samples=16)
    late, fresh = request(3, deadline_s=5.0), request(1)
    q.add(late, tokens(1, 2, 3))
    q.add(fresh, tokens(4))
    batch = q.take(timeout_s=0.0)  # two of late's samples are now being scored
    assert q.expire(now=10.0) == [late] and late.failed
    assert [s.request for s in q.pending] == [fresh]
    q.complete(batch, np.zeros(len(batch)), 0.1)
    assert late not in q.finished()


def test_a_batch_that_fails_fails_its_requests() -> None:
    q = ScoreQueue(max_batch=2, max_wait_s=0.0, max_samples=16)
    a = request(3)
    q.add(a, tokens(1, 1, 1))
    assert q.fail(q.take(timeout_s=0.0)) == [a]
    assert q.depth() == 0


def test_bucketing_keeps_the_oldest_and_the_least_padding() -> None:
    q = ScoreQueue(max_batch=3, max_wait_s=0.0, max_samples=64)
    q.add(request(1, arrival_s=0.0), tokens(10))  # the oldest
    q.add(request(6, arrival_s=1.0), tokens(1, 2, 9, 11, 30, 40))
    batch = q.take(timeout_s=0.0)
    assert sorted(len(s.tokens) for s in batch) == [9, 10, 11]


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(1, 50), min_size=1, max_size=40), st.integers(1, 8))
def test_batches_lose_nothing_and_always_carry_the_oldest(
    lengths: list[int], max_batch: int
) -> None:
    q = ScoreQueue(max_batch=max_batch, max_wait_s=0.0, max_samples=64)
    requests = [request(1, arrival_s=float(i)) for i in range(len(lengths))]
    for req, n in zip(requests, lengths, strict=True):
        q.add(req, tokens(n))
    seen = []
    while q.depth():
        oldest = q.pending[0]
        ordered = sorted(q.pending, key=lambda s: len(s.tokens))
        at, k = ordered.index(oldest), min(max_batch, len(ordered))
        batch = q.take(timeout_s=0.0)
        assert oldest in batch and len(batch) == k
        spread = max(len(s.tokens) for s in batch) - min(len(s.tokens) for s in batch)
        lengths_sorted = [len(s.tokens) for s in ordered]
        windows = [
            lengths_sorted[lo + k - 1] - lengths_sorted[lo]
            for lo in range(max(0, at - k + 1), min(at, len(ordered) - k) + 1)
        ]
        assert spread == min(windows)  # the tightest run of lengths that holds the oldest
        seen += [s.request for s in batch]
    assert sorted(map(id, seen)) == sorted(map(id, requests))


def test_bucket_around_picks_the_tightest_window() -> None:
    q = ScoreQueue(max_batch=2, max_wait_s=0.0, max_samples=8)
    q.add(request(4), tokens(5, 1, 6, 20))
    anchor = q.pending[0]
    assert sorted(len(s.tokens) for s in bucket_around(q.pending, anchor, 2)) == [5, 6]
