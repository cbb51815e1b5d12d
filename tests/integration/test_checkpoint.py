"""Checkpoints of the real tiny model: round trip, HF and vLLM loadability, `latest`, atomicity."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM

from learner.checkpoint import (
    checkpoint_dir,
    latest_checkpoint,
    load_checkpoint,
    save_checkpoint,
)


def _train_steps(model: torch.nn.Module, optimizer: torch.optim.Optimizer, steps: int) -> None:
    """A few real AdamW steps so weights move away from the build and Adam has state."""
    ids = torch.tensor([[1, 4, 5, 6, 7, 2, 3, 8]])
    for _ in range(steps):
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()


@pytest.fixture()
def trained(tiny_model_dir: Path) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    _train_steps(model, optimizer, 2)
    return model, optimizer


def _assert_same_weights(a: torch.nn.Module, b: torch.nn.Module) -> None:
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    for key in sa:
        assert torch.equal(sa[key], sb[key]), key


def test_round_trip_restores_weights_optimizer_and_state(
    tmp_path: Path, tiny_model_dir: Path, trained: tuple
) -> None:
    model, optimizer = trained
    state = {"policy_version": 7, "step": 7, "consumed_groups": 56, "note": {"seed": 0}}
    ckpt = save_checkpoint(checkpoint_dir(tmp_path, 7), model, optimizer, state, tiny_model_dir)
    assert ckpt == tmp_path / "checkpoints" / "step_00000007"
    assert {"config.json", "model.safetensors", "optimizer.pt", "state.json", "tokenizer.json"} <= {
        p.name for p in ckpt.iterdir()
    }

    fresh = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=1e-2)
    assert not torch.equal(fresh.lm_head.weight, model.lm_head.weight)
    assert load_checkpoint(ckpt, fresh, fresh_opt) == state
    _assert_same_weights(model, fresh)
    saved, restored = optimizer.state_dict(), fresh_opt.state_dict()
    assert saved["param_groups"] == restored["param_groups"]
    for idx, slots in saved["state"].items():
        for name, value in slots.items():
            assert torch.equal(value, restored["state"][idx][name]), (idx, name)
    # the same next step on both proves Adam's moments and step counts came back
    _train_steps(model, optimizer, 1)
    _train_steps(fresh, fresh_opt, 1)
    _assert_same_weights(model, fresh)


def test_checkpoint_is_a_complete_hf_model_dir(
    tmp_path: Path, tiny_model_dir: Path, trained: tuple
) -> None:
    model, optimizer = trained
    ckpt = save_checkpoint(
        tmp_path / "ck", model, optimizer, {"policy_version": 1, "step": 1}, tiny_model_dir
    )
    loaded = AutoModelForCausalLM.from_pretrained(ckpt)
    _assert_same_weights(model, loaded)
    text = "3 1 2:"
    assert (
        AutoTokenizer.from_pretrained(ckpt)(text).input_ids
        == AutoTokenizer.from_pretrained(tiny_model_dir)(text).input_ids
    )


def test_tied_embeddings_round_trip(tmp_path: Path) -> None:
    config = LlamaConfig(
        vocab_size=32,
        hidden_size=64,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        tie_word_embeddings=True,
    )
    torch.manual_seed(1)
    model = LlamaForCausalLM(config)
    ckpt = save_checkpoint(tmp_path / "tied", model, None, {"policy_version": 0, "step": 0}, None)
    torch.manual_seed(2)
    fresh = LlamaForCausalLM(config)
    load_checkpoint(ckpt, fresh, None)
    _assert_same_weights(model, fresh)
    assert fresh.lm_head.weight.data_ptr() == fresh.model.embed_tokens.weight.data_ptr()


def test_latest_pointer_fallback_and_pruning(tmp_path: Path, trained: tuple) -> None:
    model, optimizer = trained
    assert latest_checkpoint(tmp_path) is None
    for step in (1, 2, 3):
        state = {"policy_version": step, "step": step}
        save_checkpoint(checkpoint_dir(tmp_path, step), model, optimizer, state, None)
    assert latest_checkpoint(tmp_path) == checkpoint_dir(tmp_path, 3)
    assert (tmp_path / "checkpoints" / "latest").read_text().strip() == "step_00000003"
    (tmp_path / "checkpoints" / ".tmp-step_00000009-crashed").mkdir()  # a crashed write
    (tmp_path / "checkpoints" / "latest").unlink()
    assert latest_checkpoint(tmp_path) == checkpoint_dir(tmp_path, 3)
    assert latest_checkpoint(tmp_path / "checkpoints") == checkpoint_dir(tmp_path, 3)
    save_checkpoint(
        checkpoint_dir(tmp_path, 4),
        model,
        optimizer,
        {"policy_version": 4, "step": 4},
        None,
        keep_last=2,
    )
    kept = sorted(
        p.name for p in (tmp_path / "checkpoints").iterdir() if p.name.startswith("step_")
    )
    assert kept == ["step_00000003", "step_00000004"]


def test_resaving_replaces_and_a_failed_save_leaves_the_previous_one(
    tmp_path: Path, trained: tuple
) -> None:
    model, optimizer = trained
    target = checkpoint_dir(tmp_path, 5)
    save_checkpoint(target, model, optimizer, {"policy_version": 5, "step": 5, "try": 1}, None)
    save_checkpoint(target, model, optimizer, {"policy_version": 5, "step": 5, "try": 2}, None)
    assert json.loads((target / "state.json").read_text())["try"] == 2

    class FailingAdamW(torch.optim.AdamW):
        """Raises half-way through a save, after the weights were written."""

        def state_dict(self) -> dict:
            raise RuntimeError("disk full")

    failing = FailingAdamW(model.parameters())
    with pytest.raises(RuntimeError, match="disk full"):
        save_checkpoint(
            checkpoint_dir(tmp_path, 6), model, failing, {"policy_version": 6, "step": 6}, None
        )
    names = sorted(p.name for p in (tmp_path / "checkpoints").iterdir())
    assert names == ["latest", "step_00000005"]
    assert latest_checkpoint(tmp_path) == target


@pytest.mark.parametrize(
    ("state", "match"),
    [
        ({"step": 1}, "state.policy_version"),
        ({"policy_version": 1, "step": -1}, "state.step"),
        ({"policy_version": 1, "step": True}, "state.step"),
        ({"policy_version": 1, "step": 1, "bad": object()}, "state: must be JSON"),
        ({"policy_version": 1, "step": 1, "loss": float("nan")}, "state: must be JSON"),
    ],
)
def test_bad_state_is_refused_before_writing(
    tmp_path: Path, trained: tuple, state: dict, match: str
) -> None:
    model, optimizer = trained
    with pytest.raises(ValueError, match=match):
        save_checkpoint(tmp_path / "ck", model, optimizer, state, None)
    assert not tmp_path.joinpath("ck").exists()


def test_load_refuses_what_is_not_a_checkpoint(
    tmp_path: Path, tiny_model_dir: Path, trained: tuple
) -> None:
    model, optimizer = trained
    with pytest.raises(ValueError, match="ckpt_dir: .* is not a checkpoint"):
        load_checkpoint(tiny_model_dir, model, optimizer)
    ckpt = save_checkpoint(tmp_path / "ck", model, None, {"policy_version": 0, "step": 0}, None)
    with pytest.raises(ValueError, match="optimizer.pt"):
        load_checkpoint(ckpt, model, optimizer)
    with pytest.raises(ValueError, match="tokenizer_dir"):
        save_checkpoint(tmp_path / "ck2", model, None, {"policy_version": 0, "step": 0}, tmp_path)


_VLLM_SCRIPT = textwrap.dedent(
    """
    import json, sys
    from vllm import LLM, SamplingParams
    if __name__ == "__main__":
        llm = LLM(model=sys.argv[1], enforce_eager=True, dtype="float32", seed=0,
                  kv_cache_memory_bytes=2**28, generation_config="vllm")
        params = SamplingParams(temperature=0.0, max_tokens=6, logprobs=0)
        out = llm.generate([{"prompt_token_ids": json.loads(sys.argv[2])}], params, use_tqdm=False)
        c = out[0].outputs[0]
        lps = [step[t].logprob for step, t in zip(c.logprobs, c.token_ids)]
        print("RESULT " + json.dumps({"tokens": list(c.token_ids), "logprobs": lps}))
    """
)


@pytest.mark.slow
def test_vllm_loads_the_checkpoint(tmp_path: Path, tiny_model_dir: Path, trained: tuple) -> None:
    model, optimizer = trained
    ckpt = save_checkpoint(
        tmp_path / "ck", model, optimizer, {"policy_version": 2, "step": 2}, tiny_model_dir
    )
    prompt = [1, 4, 5, 6]
    env = os.environ | {
        "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
        "VLLM_CPU_KVCACHE_SPACE": "1",
        "HF_HUB_OFFLINE": "1",
    }
    proc = subprocess.run(
        [sys.executable, "-c", _VLLM_SCRIPT, str(ckpt), json.dumps(prompt)],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    line = next(ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT "))
    result = json.loads(line.removeprefix("RESULT "))
    # the logprobs vLLM reports are those of the trained weights, as transformers computes them
    expected = _completion_logprobs(model, prompt, result["tokens"])
    assert result["logprobs"] == pytest.approx(expected, abs=1e-4)
    # and not those of the untrained build the checkpoint started from
    untrained = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    before = _completion_logprobs(untrained, prompt, result["tokens"])
    assert max(abs(a - b) for a, b in zip(before, expected, strict=True)) > 1e-2


def _completion_logprobs(
    model: torch.nn.Module, prompt: list[int], tokens: list[int]
) -> list[float]:
    ids = torch.tensor([prompt + tokens])
    with torch.no_grad():
        logp = torch.log_softmax(model(input_ids=ids).logits[0].double(), dim=-1)
    return [logp[len(prompt) - 1 + i, t].item() for i, t in enumerate(tokens)]
