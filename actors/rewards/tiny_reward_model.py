"""The tiny reward model of the `sort` task, built and fitted locally in seconds.

`ensure_reward_model(cache_dir, num_digits)` returns a Hugging Face directory holding a
`LlamaForSequenceClassification` (num_labels=1, pad token `<pad>`) with the tiny character
tokenizer of asyncrl/models/tiny.py. It is fitted by regression on generated completions of
sort prompts, labelled by the task's verifier (actors/envs/sort_task.py): exact
answers, the prompt's digits in other orders, wrong digits, too short or too long answers,
with and without `<eos>`. So its score tracks sort correctness (`fit.json` in the directory
records the held-out correlation with the verifier) and a policy trained with it visibly
learns. Like the policy's tiny model, a build is keyed by the hash of its settings and
renamed into place atomically; an existing build is reused as is.

    python -m actors.rewards.tiny_reward_model CACHE_DIR [--num-digits 4]   prints the directory
"""

from __future__ import annotations

import argparse
import hashlib
import json
import random
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch
from transformers import LlamaConfig, LlamaForSequenceClassification

from actors.envs.sort_task import SortVerifier, answer_for, render_prompt
from asyncrl.models.tiny import BOS, EOS, MAX_POSITIONS, PAD, build_once, build_tokenizer, vocab

BUILD_FORMAT = 1


@dataclass(frozen=True)
class FitSettings:
    """Everything that shapes a build (hashed into its directory name)."""

    num_digits: int = 4
    hidden_size: int = 64
    num_layers: int = 2
    num_heads: int = 4
    steps: int = 300
    batch_size: int = 64
    lr: float = 3e-3
    seed: int = 0
    build_format: int = BUILD_FORMAT


def ensure_reward_model(cache_dir: str | Path, num_digits: int = 4) -> Path:
    """The tiny sort reward model's directory under `cache_dir`, built on first use."""
    settings = FitSettings(num_digits=num_digits)
    blob = json.dumps(asdict(settings), sort_keys=True).encode()
    final = Path(cache_dir).expanduser() / f"tiny-sort-rm-{hashlib.sha256(blob).hexdigest()[:16]}"
    return build_once(final, lambda tmp: build(settings, tmp))


def sample_completion(rng: random.Random, digits: str) -> str:
    """A completion of the kinds a policy learning `sort` writes, good and bad."""
    answer = answer_for(digits)
    kind = rng.randrange(6)
    if kind == 0:
        text = answer
    elif kind == 1:
        text = "".join(rng.sample(digits, len(digits)))
    elif kind == 2:  # one or two digits wrong
        chars = list(answer)
        for _ in range(rng.randint(1, 2)):
            chars[rng.randrange(len(chars))] = str(rng.randrange(10))
        text = "".join(chars)
    elif kind == 3:  # too short or too long
        cut = rng.randint(0, len(answer) + 3)
        text = (answer + "".join(str(rng.randrange(10)) for _ in range(3)))[:cut]
    else:
        length = rng.randint(0, len(digits) + 2)
        text = "".join(rng.choice("0123456789: ") for _ in range(length))
    return text + (EOS if rng.random() < 0.8 else "")


def make_data(settings: FitSettings, num: int, seed: int) -> tuple[list[str], np.ndarray]:
    """`num` texts (prompt + completion) and their verifier rewards."""
    rng, verifier = random.Random(seed), SortVerifier()
    texts, labels = [], []
    for _ in range(num):
        digits = "".join(str(rng.randrange(10)) for _ in range(settings.num_digits))
        prompt, completion = render_prompt(digits), sample_completion(rng, digits)
        texts.append(prompt + completion)
        labels.append(verifier.score(prompt, completion, {"digits": digits}).reward)
    return texts, np.asarray(labels, np.float32)


def new_model(settings: FitSettings) -> LlamaForSequenceClassification:
    ids = vocab()
    config = LlamaConfig(
        vocab_size=len(ids),
        hidden_size=settings.hidden_size,
        intermediate_size=2 * settings.hidden_size,
        num_hidden_layers=settings.num_layers,
        num_attention_heads=settings.num_heads,
        num_key_value_heads=settings.num_heads,
        max_position_embeddings=MAX_POSITIONS,
        num_labels=1,
        bos_token_id=ids[BOS],
        eos_token_id=ids[EOS],
        pad_token_id=ids[PAD],
    )
    return LlamaForSequenceClassification(config)


def _batch(tokenizer: object, texts: Sequence[str]) -> dict[str, torch.Tensor]:
    enc = tokenizer(list(texts), padding=True, return_tensors="pt", padding_side="right")
    return {"input_ids": enc["input_ids"], "attention_mask": enc["attention_mask"]}


def build(settings: FitSettings, out: Path) -> dict[str, float]:
    """Fit a fresh model on generated data and save it (with fit.json) into `out`."""
    tokenizer = build_tokenizer()
    start = time.perf_counter()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # a model this small trains fastest on one core (no contention)
    try:
        _fit(settings, tokenizer, out)
    finally:
        torch.set_num_threads(threads)
    fit = json.loads((out / "fit.json").read_text())
    fit["fit_s"] = time.perf_counter() - start
    (out / "fit.json").write_text(json.dumps(fit, indent=1))
    return fit


def _fit(settings: FitSettings, tokenizer: object, out: Path) -> None:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(settings.seed)
        model = new_model(settings)
        texts, labels = make_data(settings, settings.steps * settings.batch_size, settings.seed)
        optimizer = torch.optim.AdamW(model.parameters(), lr=settings.lr)
        model.train()
        for step in range(settings.steps):
            lo = step * settings.batch_size
            batch = _batch(tokenizer, texts[lo : lo + settings.batch_size])
            target = torch.from_numpy(labels[lo : lo + settings.batch_size])
            loss = torch.nn.functional.mse_loss(model(**batch).logits[:, 0], target)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
    fit = evaluate(model, tokenizer, settings)
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    (out / "fit.json").write_text(json.dumps({**fit, "settings": asdict(settings)}, indent=1))


@torch.inference_mode()
def evaluate(model: torch.nn.Module, tokenizer: object, settings: FitSettings) -> dict[str, float]:
    """Held-out agreement with the verifier: Pearson correlation and mean squared error."""
    model.eval()
    texts, labels = make_data(settings, 1024, settings.seed + 1)
    scores = model(**_batch(tokenizer, texts)).logits[:, 0].numpy()
    return {
        "heldout_correlation": float(np.corrcoef(scores, labels)[0, 1]),
        "heldout_mse": float(np.mean((scores - labels) ** 2)),
    }


def main(argv: Sequence[str]) -> int:
    p = argparse.ArgumentParser(description="Build the tiny sort reward model.")
    p.add_argument("cache_dir", help="directory to build into (a hashed subdirectory)")
    p.add_argument("--num-digits", type=int, default=4)
    args = p.parse_args(list(argv))
    print(ensure_reward_model(args.cache_dir, args.num_digits))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
