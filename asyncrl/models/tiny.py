"""The embedded default model: a tiny random Llama and its character tokenizer, built locally.

`ensure_model(model, task)` returns a Hugging Face model directory that transformers and vLLM
both load offline. With `model.path` set it is that directory; otherwise the tiny model is built
into `<model.cache_dir>/<hash of its settings>/` from nothing but the config (nothing is ever
downloaded):

- tokenizer: one token per character over a fixed alphabet (digits, ':', ' ') plus the special
  tokens `<pad>`, `<bos>`, `<eos>`, `<unk>`; 16 tokens in all (a multiple of 8). A task that
  needs more characters (the `lookup` task's call syntax) adds them with `model.extra_chars`;
  the vocabulary is then padded with unused `<unusedN>` tokens to a multiple of 8 again. It is
  made with `tokenizers`, prepends `<bos>` to every encoded text, and is saved as a
  `PreTrainedTokenizerFast`;
- model: `LlamaForCausalLM` with untied embeddings (or another family, `model.arch`: see
  asyncrl/models/families.py), widths from `ModelConfig`, seeded random initialisation
  (`model.init_seed`), saved as safetensors in `model.dtype`.

Builds are atomic: a process builds into a private temporary directory and renames it into
place; a process that loses the race discards its copy and uses the winner's. An existing build
is reused as is, so every process of a run (actors, learner) sees byte-identical weights.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

import torch
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors
from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast

from asyncrl.config import ModelConfig, TaskConfig
from asyncrl.models.families import family_config

BUILD_FORMAT = 1
"""Bumped whenever the built files change for the same settings (invalidates cached builds)."""
PAD, BOS, EOS, UNK = "<pad>", "<bos>", "<eos>", "<unk>"
SPECIAL_TOKENS = (PAD, BOS, EOS, UNK)
ALPHABET = tuple("0123456789") + (":", " ")
"""Every character a prompt or an answer of the built-in tasks may contain."""
MAX_POSITIONS = 128
"""Longest sequence (prompt + completion) the tiny model is built for, in tokens."""

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def ensure_model(model: ModelConfig, task: TaskConfig) -> Path:
    """Return the model directory for `model`, building the tiny model on first use."""
    if model.path:
        path = Path(model.path).expanduser()
        if not path.is_dir():
            raise ValueError(f"model.path: directory not found: {str(path)!r}")
        return path
    cache = Path(model.cache_dir).expanduser()
    return build_once(cache / build_key(model), lambda tmp: _build(model, tmp))


def build_once(final: Path, build: Callable[[Path], None]) -> Path:
    """`final`, built by `build(tmp)` into a private directory renamed into place, unless a
    build (`config.json`) is there already; of processes racing, the first rename wins."""
    if (final / "config.json").is_file():
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".build-{final.name}-", dir=final.parent))
    try:
        build(tmp)
        os.chmod(tmp, 0o755)  # mkdtemp makes it private; a model cache is readable like any other
        os.rename(tmp, final)  # atomic; fails if another process already renamed its build in
    except OSError:
        if not (final / "config.json").is_file():
            raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return final


def build_key(model: ModelConfig) -> str:
    """Directory name of a tiny-model build: a hash of every setting that shapes its files."""
    settings = dataclasses.asdict(model)
    for unrelated in ("path", "cache_dir"):
        settings.pop(unrelated)
    if not settings["extra_chars"]:
        settings.pop("extra_chars")  # the default alphabet keeps the builds it always had
    if model.arch == "llama":  # the embedded default keeps the key it had before families
        settings.pop("arch")
        settings.pop("num_experts")
    settings["build_format"] = BUILD_FORMAT
    settings["alphabet"] = "".join(ALPHABET)
    settings["max_positions"] = MAX_POSITIONS
    blob = json.dumps(settings, sort_keys=True).encode()
    return f"tiny-{model.arch.replace('_', '-')}-" + hashlib.sha256(blob).hexdigest()[:16]


def vocab(extra_chars: str = "") -> dict[str, int]:
    """Token -> id of the tiny tokenizer: special tokens first, then the alphabet, then
    `extra_chars` and (with extra characters only) unused tokens up to a multiple of 8."""
    clash = sorted(set(extra_chars) & set(ALPHABET))
    if clash:
        raise ValueError(f"model.extra_chars: {clash} are in the alphabet already")
    tokens = list(SPECIAL_TOKENS + ALPHABET) + list(extra_chars)
    while extra_chars and len(tokens) % 8:
        tokens.append(f"<unused{len(tokens)}>")
    return {tok: i for i, tok in enumerate(tokens)}


def build_tokenizer(extra_chars: str = "") -> PreTrainedTokenizerFast:
    """The tiny character-level tokenizer (adds `<bos>` in front of every encoded text)."""
    ids = vocab(extra_chars)
    tok = Tokenizer(models.WordLevel(vocab=ids, unk_token=UNK))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A $B", special_tokens=[(BOS, ids[BOS])]
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=BOS,
        eos_token=EOS,
        pad_token=PAD,
        unk_token=UNK,
        model_max_length=MAX_POSITIONS,
        padding_side="left",
    )


def _build(model: ModelConfig, out: Path) -> None:
    build_tokenizer(model.extra_chars).save_pretrained(out)
    ids = vocab(model.extra_chars)
    special = {"bos": ids[BOS], "eos": ids[EOS], "pad": ids[PAD]}
    config = family_config(model, len(ids), special, MAX_POSITIONS)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(model.init_seed)
        llama = AutoModelForCausalLM.from_config(config)
    llama.to(_DTYPES[model.dtype])
    llama.save_pretrained(out, safe_serialization=True)
