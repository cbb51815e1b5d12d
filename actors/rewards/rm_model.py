"""A reward model in this process: any Hugging Face `AutoModelForSequenceClassification`
directory with a single scalar head, its tokenizer, and the hash of its config and weights.

`RewardModel.tokenize` turns (prompt, completion) pairs into token ids (`prompt + completion`
as one text, cut to the last `max_length_tokens` tokens: the score is read at the last token);
`score_tokens` scores one batch of them, right-padded with the pad token, so every real token
keeps the position it has unpadded and the model's pooling (the rightmost non-pad token) reads
the same hidden state as for the sample alone. The reward-model server (rm_server.py) and the
in-process baseline of bench/reward_server.py both score through this class.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch
from transformers import AutoConfig, AutoModelForSequenceClassification, AutoTokenizer

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt")


def weights_hash(model_dir: str | Path) -> str:
    """The checkpoint id: sha256 (first 16 hex digits) over the model directory's config.json
    and weight files, in name order (a copy of the directory has the same id)."""
    root = Path(model_dir)
    weights = [p for p in root.iterdir() if p.suffix in WEIGHT_SUFFIXES and p.is_file()]
    if not weights:
        raise ValueError(f"--model: no weight files ({', '.join(WEIGHT_SUFFIXES)}) in {root}")
    files = sorted([root / "config.json", *weights])
    digest = hashlib.sha256()
    for path in files:
        digest.update(path.name.encode())
        with path.open("rb") as f:
            for chunk in iter(lambda: f.read(1 << 20), b""):
                digest.update(chunk)
    return digest.hexdigest()[:16]


def pick_device(device: str) -> torch.device:
    """`auto` = the first GPU when CUDA is present, else the CPU."""
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda" and not torch.cuda.is_available():
        raise ValueError("reward_model.device: cuda requested but torch sees no CUDA device")
    return torch.device(device)


class RewardModel:
    """A loaded sequence-classification model with one output, ready to score batches."""

    def __init__(
        self,
        model_dir: str | Path,
        *,
        device: str = "auto",
        dtype: str = "float32",
        max_length_tokens: int = 1024,
    ) -> None:
        root = Path(model_dir).expanduser()
        if not (root / "config.json").is_file():
            raise ValueError(f"--model: {str(root)!r} is not a Hugging Face model directory")
        self.model_dir = str(root.resolve())
        self.model_hash = weights_hash(root)
        self.device = pick_device(device)
        num_labels = AutoConfig.from_pretrained(root).num_labels
        if num_labels != 1:
            raise ValueError(
                f"--model: {root} has num_labels={num_labels}; "
                "a reward model has a single scalar head (num_labels=1)"
            )
        self.tokenizer = AutoTokenizer.from_pretrained(root)
        self.tokenizer.truncation_side = "left"  # keep the end: the score is read there
        self.model = AutoModelForSequenceClassification.from_pretrained(root, dtype=_DTYPES[dtype])
        self.pad_id = self._pad_id()
        self.max_length_tokens = max_length_tokens
        self.model.to(self.device).eval()

    def _pad_id(self) -> int:
        """The pad token the model pools by: the model config's, else the tokenizer's."""
        pad = self.model.config.pad_token_id
        if pad is None:
            pad = self.tokenizer.pad_token_id
        if pad is None:
            raise ValueError(
                f"--model: {self.model_dir} sets no pad token (config.pad_token_id or the "
                "tokenizer's pad_token); batched scoring needs one"
            )
        self.model.config.pad_token_id = int(pad)
        return int(pad)

    def tokenize(self, prompts: Sequence[str], completions: Sequence[str]) -> list[list[int]]:
        """Token ids of every `prompt + completion`, cut to the last max_length_tokens."""
        texts = [p + c for p, c in zip(prompts, completions, strict=True)]
        out = self.tokenizer(
            texts, truncation=True, max_length=self.max_length_tokens, padding=False
        )
        return [list(ids) for ids in out["input_ids"]]

    @torch.inference_mode()
    def score_tokens(self, batch: Sequence[Sequence[int]]) -> np.ndarray:
        """float32 [len(batch)]: one forward pass over the right-padded batch."""
        width = max(len(ids) for ids in batch)
        input_ids = torch.full((len(batch), width), self.pad_id, dtype=torch.long)
        mask = torch.zeros((len(batch), width), dtype=torch.long)
        for row, ids in enumerate(batch):
            input_ids[row, : len(ids)] = torch.as_tensor(ids, dtype=torch.long)
            mask[row, : len(ids)] = 1
        out = self.model(input_ids=input_ids.to(self.device), attention_mask=mask.to(self.device))
        return out.logits[:, 0].float().cpu().numpy()

    def score(self, prompts: Sequence[str], completions: Sequence[str]) -> np.ndarray:
        """Tokenize and score in one batch (the in-process way of calling the model)."""
        return self.score_tokens(self.tokenize(prompts, completions))
