"""`asyncrl reward-server` as a real process on loopback with the tiny sort reward model: the
same scores as in-process, dynamic batching, the bounded queue, Errors naming the field and
request timeouts. Client timeouts and restarts, CURVE auth and refused settings:
test_reward_server_lifecycle.py."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import zmq
from reward_server_cases import (
    COMPLETIONS,
    PROMPTS,
    WAIT_S,
    ServerProcess,
    request_header,
    sets,
)
from wire_checks import dealer, refused, reply, wait_for

from actors.rewards.rm_client import RewardModelClient, RewardModelComponent
from actors.rewards.rm_model import RewardModel, weights_hash
from asyncrl.protocol.codec import encode
from asyncrl.protocol.messages import PROTOCOL_VERSION, Error, Hello, ScoreRequest, Scores


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, rm_dir: Path) -> Iterator[ServerProcess]:
    """Small batches, short wait, a queue of only 16 samples."""
    proc = ServerProcess(
        tmp_path_factory.mktemp("rm"),
        rm_dir,
        *sets(max_batch=8, max_wait_ms=5, max_queue_samples=16),
    )
    yield proc
    proc.kill()


@pytest.fixture(scope="module")
def patient(tmp_path_factory: pytest.TempPathFactory, rm_dir: Path) -> Iterator[ServerProcess]:
    """A server whose partial batches wait a minute: batches run only when full."""
    proc = ServerProcess(
        tmp_path_factory.mktemp("rm"),
        rm_dir,
        *sets(max_batch=8, max_wait_ms=60000, max_queue_samples=64),
    )
    yield proc
    proc.kill()


@pytest.fixture(scope="module")
def held(tmp_path_factory: pytest.TempPathFactory, rm_dir: Path) -> Iterator[ServerProcess]:
    """Batches of 16 samples only (a partial one waits a minute), and a queue of 16."""
    proc = ServerProcess(
        tmp_path_factory.mktemp("rm"),
        rm_dir,
        *sets(max_batch=16, max_wait_ms=60000, max_queue_samples=16),
    )
    yield proc
    proc.kill()


@pytest.fixture
def raw(server: ServerProcess) -> Iterator[zmq.Socket]:
    with dealer(server.endpoint) as sock:
        yield sock


# --- scores -------------------------------------------------------------------------------------


def test_served_scores_equal_in_process_scores(server: ServerProcess, rm_dir: Path) -> None:
    client = RewardModelClient(server.endpoint, timeout_s=WAIT_S)
    try:
        futures = [client.submit(PROMPTS[i:], COMPLETIONS[i:]) for i in range(len(PROMPTS))]
        results = [f.result() for f in futures]
    finally:
        client.close()
    model = RewardModel(rm_dir)
    alone = np.array([model.score([p], [c])[0] for p, c in zip(PROMPTS, COMPLETIONS, strict=True)])
    for i, res in enumerate(results):
        np.testing.assert_allclose(res.scores, alone[i:], rtol=0, atol=1e-5)
        assert res.model_hash == weights_hash(rm_dir) and res.model_dir == str(rm_dir.resolve())
    assert alone[0] > alone[2]  # a right answer scores above a wrong one


def test_component_scores_items_and_records_the_checkpoint(server: ServerProcess) -> None:
    class Item:
        def __init__(self, prompt: str, completion: str) -> None:
            self.prompt, self.completion = prompt, completion

    component = RewardModelComponent(RewardModelClient(server.endpoint), chunk=2)
    try:
        pending = component.submit([Item(p, c) for p, c in zip(PROMPTS, COMPLETIONS, strict=True)])
        scores = pending.result()
    finally:
        component.close()
    assert len(scores) == len(PROMPTS) and not any(s.failed for s in scores)
    assert set(component.provenance()) == {"reward_model_dir", "reward_model_hash"}
    assert all(np.isfinite(s.value) for s in scores)


def test_component_scores_token_ids_like_their_texts(server: ServerProcess) -> None:
    vocab = sorted(set("".join(PROMPTS + COMPLETIONS)))  # a toy policy tokenizer: one id a char

    def encode_text(text: str) -> list[int]:
        return [vocab.index(ch) for ch in text]

    def decode(ids: Any) -> str:
        return "".join(vocab[i] for i in ids)

    component = RewardModelComponent(RewardModelClient(server.endpoint, timeout_s=WAIT_S))
    try:
        ids = component.submit_tokens(
            [encode_text(p) for p in PROMPTS], [encode_text(c) for c in COMPLETIONS], decode
        ).result()
        texts = component.client.score([p + c for p, c in zip(PROMPTS, COMPLETIONS, strict=True)])
    finally:
        component.close()
    assert [s.value for s in ids] == pytest.approx(texts, abs=1e-5)


def test_concurrent_clients_each_get_their_own_scores(server: ServerProcess, rm_dir: Path) -> None:
    model = RewardModel(rm_dir)
    texts = [p + c for p, c in zip(PROMPTS, COMPLETIONS, strict=True)]
    expected = [float(model.score([""], [t])[0]) for t in texts]
    results: dict[int, list[list[float]]] = {}

    def one_client(k: int) -> None:
        client = RewardModelClient(
            server.endpoint, client_id=f"c{k}", timeout_s=WAIT_S, retries=20, backoff_s=0.01
        )
        try:  # each client asks for a different rotation of the texts, several in flight
            mine = texts[k:] + texts[:k]
            futures = [client.score_async(mine) for _ in range(4)]
            results[k] = [f.result() for f in futures]
        finally:
            client.close()

    threads = [threading.Thread(target=one_client, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(results) == [0, 1, 2, 3]
    for k, replies in results.items():
        for got in replies:
            np.testing.assert_allclose(got, expected[k:] + expected[:k], rtol=0, atol=1e-5)


def test_full_batches_run_together(patient: ServerProcess) -> None:
    client = RewardModelClient(patient.endpoint, timeout_s=WAIT_S)
    try:
        before = client.server_stats()
        pairs = list(zip(PROMPTS, COMPLETIONS, strict=True)) * 2
        futures = [client.submit([p], [c]) for p, c in pairs[:8]]
        assert all(len(f.result().scores) == 1 for f in futures)
        after = client.server_stats()
    finally:
        client.close()
    assert after["batches"] - before["batches"] == 1  # 8 requests of 1 sample: one batch of 8
    assert after["largest_batch"] == 8
    assert after["batch_sizes"].get("8", 0) - before["batch_sizes"].get("8", 0) == 1


def test_a_request_past_its_timeout_gets_a_timeout_error(patient: ServerProcess) -> None:
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(patient.endpoint)
    try:  # one sample never fills a batch of 8 on this server: it waits past its timeout
        sock.send_multipart(
            encode(ScoreRequest(request_id=5, prompts=["1:"], completions=["1"], timeout_s=0.3))
        )
        msg = reply(sock)
    finally:
        sock.close()
        ctx.term()
    assert isinstance(msg, Error)
    assert (msg.code, msg.field, msg.request_id) == ("timeout", "timeout_s", 5)


# --- bad requests -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("frames", "field", "request_id"),
    [
        ([b"\xc1garbage"], "header", -1),
        (request_header(protocol=PROTOCOL_VERSION + 1), "protocol", 77),
        (request_header(completions=[]), "completions", 77),
        (request_header(prompts=[], completions=[]), "prompts", 77),
        (request_header(prompts=[3]), "prompts", 77),
        (request_header(timeout_s=-1.0), "timeout_s", 77),
        (request_header(timeout_s=float("nan")), "timeout_s", 77),
        (request_header(request_id="seven"), "request_id", -1),
        (
            encode(Hello(role="actor", client_id="x", protocol_version=1, config_hash="c")),
            "type",
            -1,
        ),
    ],
    ids=["garbage", "protocol", "count", "empty", "types", "negative", "nan", "id", "hub-message"],
)
def test_bad_requests_get_an_error_naming_the_field(
    raw: zmq.Socket, server: ServerProcess, frames: list[Any], field: str, request_id: int
) -> None:
    err = refused(raw, frames)
    assert err.field == field and err.request_id == request_id
    raw.send_multipart(encode(ScoreRequest(request_id=1, prompts=["3:"], completions=["3"])))
    assert isinstance(reply(raw), Scores)  # the same connection is still served


def test_a_full_queue_answers_overloaded_and_loses_no_accepted_request(
    server: ServerProcess, raw: zmq.Socket
) -> None:
    before = RewardModelClient(server.endpoint, timeout_s=WAIT_S)
    scored_before = before.server_stats()["samples_scored"]
    num = 60  # 8 samples each against a queue of 16: far faster in than out
    for i in range(num):
        raw.send_multipart(
            encode(ScoreRequest(request_id=i, prompts=["3141:"] * 8, completions=["1134"] * 8))
        )
    replies = [reply(raw) for _ in range(num)]
    assert sorted(r.request_id for r in replies) == list(range(num))  # every one answered
    overloaded = [r for r in replies if isinstance(r, Error)]
    assert overloaded and all((r.code, r.field) == ("overloaded", "prompts") for r in overloaded)
    accepted = [r for r in replies if isinstance(r, Scores)]
    assert accepted and all(len(r.scores) == 8 for r in accepted)  # no accepted one lost
    assert len(accepted) + len(overloaded) == num
    try:
        assert before.server_stats()["samples_scored"] - scored_before == 8 * len(accepted)
    finally:
        before.close()


def test_an_overloaded_client_retries_until_its_request_fits(held: ServerProcess) -> None:
    """Deterministic: 15 of the queue's 16 samples are held waiting for a 16th, so the client's 8
    must be refused; once it has retried, a 16th sample lets the batch run and the retry fits."""
    client = RewardModelClient(
        held.endpoint, timeout_s=WAIT_S, retries=1000, backoff_s=0.01, max_backoff_s=0.02
    )
    with dealer(held.endpoint) as raw:
        try:
            raw.send_multipart(
                encode(
                    ScoreRequest(request_id=1, prompts=["3141:"] * 15, completions=["1134"] * 15)
                )
            )
            wait_for(lambda: client.server_stats()["queue_depth"] == 15, "15 samples queued")
            future = client.submit(["3141:"] * 8, ["1134"] * 8)  # 15 + 8 > 16: overloaded
            wait_for(lambda: client.stats["retries"] > 0, "the client to retry")
            assert not future.done()
            raw.send_multipart(
                encode(ScoreRequest(request_id=2, prompts=["12:"], completions=["21"]))
            )
            first = sorted((reply(raw), reply(raw)), key=lambda r: r.request_id)
            assert [(type(r), len(r.scores)) for r in first] == [(Scores, 15), (Scores, 1)]
            # the client's retry now fits (8 of 16); 8 more samples fill the next batch
            raw.send_multipart(
                encode(ScoreRequest(request_id=3, prompts=["9870:"] * 8, completions=["0789"] * 8))
            )
            last = reply(raw)
            assert isinstance(last, Scores) and last.request_id == 3, last
            result = future.result(timeout=WAIT_S)
            assert len(result.scores) == 8 and result.attempts >= 2
            assert client.stats["retries"] == result.attempts - 1
            errors = client.server_stats()["errors"]
            assert errors.get("overloaded", 0) >= 1 and set(errors) == {"overloaded"}
        finally:
            client.close()
