"""Learner checkpoints: a complete Hugging Face model directory plus optimizer and run state.

Layout under a run directory:

    <run_dir>/checkpoints/
        step_00000200/              a complete HF model dir (transformers and vLLM load it as is)
            config.json  generation_config.json  model.safetensors (or shards + index)
            tokenizer.json  tokenizer_config.json  special_tokens_map.json ...
            optimizer.pt            torch.save(optimizer.state_dict()), loaded weights_only
            state.json              {"policy_version": ..., "step": ..., anything else given}
        latest                      text file: the name of the newest complete checkpoint

Writes are atomic: everything goes into a private `.tmp-*` directory next to the target, which
is renamed into place only when complete; `latest` is replaced (write + rename) afterwards. A
crash leaves either the previous checkpoint or the new one, never half of one; stray `.tmp-*`
directories are ignored by `latest_checkpoint`. Re-saving an existing directory replaces it.

Weights are written by `model.save_pretrained` (safetensors; tied weights are stored once).
Under FSDP the caller gathers a full state dict on rank 0 and passes it as `model_state_dict`;
only rank 0 calls `save_checkpoint`. `load_checkpoint` loads full tensors into an unsharded
model, so resume before `fully_shard`; the optimizer state it restores is the one saved (a
sharded optimizer's state is per rank and is not covered here).
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file

STATE_FILE = "state.json"
OPTIMIZER_FILE = "optimizer.pt"
LATEST_FILE = "latest"
CHECKPOINTS = "checkpoints"
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.json",
    "vocab.txt",
    "merges.txt",
    "tokenizer.model",
    "chat_template.jinja",
    "chat_template.json",
)
"""Files copied from `tokenizer_dir` so the checkpoint is a self-contained model directory."""


def checkpoint_dir(run_dir: str | Path, step: int) -> Path:
    """Where the checkpoint of optimizer step `step` lives: <run_dir>/checkpoints/step_<step>."""
    if step < 0:
        raise ValueError(f"step: must be >= 0, got {step}")
    return Path(run_dir) / CHECKPOINTS / f"step_{step:08d}"


def save_checkpoint(
    ckpt_dir: str | Path,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer | None,
    state: dict[str, Any],
    tokenizer_dir: str | Path | None,
    *,
    model_state_dict: dict[str, torch.Tensor] | None = None,
    keep_last: int = 0,
) -> Path:
    """Write a checkpoint atomically into `ckpt_dir`, point `latest` at it, return its path.

    `state` must hold integer `policy_version` and `step` and be JSON-serialisable. `model` is a
    transformers `PreTrainedModel`. `keep_last` > 0 deletes all but the newest `keep_last`
    checkpoints in the same parent directory.
    """
    ckpt_dir = Path(ckpt_dir)
    blob = _state_json(state)
    if keep_last < 0:
        raise ValueError(f"keep_last: must be >= 0, got {keep_last}")
    tok_files = _tokenizer_files(tokenizer_dir)
    parent = ckpt_dir.parent
    parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".tmp-{ckpt_dir.name}-", dir=parent))
    try:
        os.chmod(tmp, 0o755)
        model.save_pretrained(tmp, state_dict=model_state_dict)
        assert any(tmp.glob("*.safetensors")), f"save_pretrained wrote no safetensors in {tmp}"
        for src in tok_files:
            shutil.copy2(src, tmp / src.name)
        if optimizer is not None:
            torch.save(optimizer.state_dict(), tmp / OPTIMIZER_FILE)
        (tmp / STATE_FILE).write_text(blob)
        _fsync_tree(tmp)
        _replace_dir(tmp, ckpt_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    _write_latest(parent, ckpt_dir.name)
    if keep_last:
        _prune(parent, keep_last, keep=ckpt_dir.name)
    return ckpt_dir


def load_checkpoint(
    ckpt_dir: str | Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None
) -> dict[str, Any]:
    """Load weights (and optimizer state when `optimizer` is given); return the saved state."""
    ckpt_dir = Path(ckpt_dir)
    state_path = ckpt_dir / STATE_FILE
    if not state_path.is_file():
        raise ValueError(f"ckpt_dir: {ckpt_dir} is not a checkpoint (no {STATE_FILE})")
    _load_weights(ckpt_dir, model)
    if optimizer is not None:
        opt_path = ckpt_dir / OPTIMIZER_FILE
        if not opt_path.is_file():
            raise ValueError(f"ckpt_dir: {ckpt_dir} holds no {OPTIMIZER_FILE}")
        optimizer.load_state_dict(torch.load(opt_path, map_location="cpu", weights_only=True))
    return json.loads(state_path.read_text())


def latest_checkpoint(run_dir: str | Path) -> Path | None:
    """The newest complete checkpoint under `run_dir` (or under `run_dir/checkpoints`), if any.

    Follows the `latest` pointer; if it is missing or dangling, falls back to the complete
    checkpoint with the highest saved `step`.
    """
    base = Path(run_dir)
    if (base / CHECKPOINTS).is_dir():
        base = base / CHECKPOINTS
    pointer = base / LATEST_FILE
    if pointer.is_file():
        target = base / pointer.read_text().strip()
        if (target / STATE_FILE).is_file():
            return target
    complete = _complete_checkpoints(base)
    return complete[-1] if complete else None


def _state_json(state: dict[str, Any]) -> str:
    if not isinstance(state, dict):
        raise ValueError(f"state: must be a dict, got {type(state).__name__}")
    for key in ("policy_version", "step"):
        value = state.get(key)
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ValueError(f"state.{key}: must be an integer >= 0, got {value!r}")
    try:
        return json.dumps(state, indent=2, sort_keys=True, allow_nan=False)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"state: must be JSON-serialisable with finite numbers: {exc}") from exc


def _tokenizer_files(tokenizer_dir: str | Path | None) -> list[Path]:
    if tokenizer_dir is None:
        return []
    tokenizer_dir = Path(tokenizer_dir)
    files = [tokenizer_dir / name for name in TOKENIZER_FILES if (tokenizer_dir / name).is_file()]
    if not files:
        raise ValueError(f"tokenizer_dir: no tokenizer files in {tokenizer_dir}")
    return files


def _load_weights(ckpt_dir: Path, model: torch.nn.Module) -> None:
    index = ckpt_dir / "model.safetensors.index.json"
    if index.is_file():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    else:
        names = ["model.safetensors"]
    tensors: dict[str, torch.Tensor] = {}
    for name in names:
        if not (ckpt_dir / name).is_file():
            raise ValueError(f"ckpt_dir: {ckpt_dir} is missing {name}")
        tensors.update(load_file(ckpt_dir / name))
    result = model.load_state_dict(tensors, strict=False)
    if result.unexpected_keys:
        raise ValueError(f"ckpt_dir: weights not in the model: {result.unexpected_keys[:5]}")
    # save_pretrained stores tied weights once: a missing key must share storage with a loaded one
    own = model.state_dict()
    loaded_ptrs = {own[k].data_ptr() for k in tensors}
    untied = [k for k in result.missing_keys if own[k].data_ptr() not in loaded_ptrs]
    if untied:
        raise ValueError(f"ckpt_dir: weights missing from the checkpoint: {untied[:5]}")


def _replace_dir(tmp: Path, target: Path) -> None:
    if not target.exists():
        os.rename(tmp, target)
        return
    old = Path(tempfile.mkdtemp(prefix=f".old-{target.name}-", dir=target.parent))
    os.rename(target, old / target.name)
    os.rename(tmp, target)
    shutil.rmtree(old, ignore_errors=True)


def _write_latest(parent: Path, name: str) -> None:
    tmp = parent / f".{LATEST_FILE}.{os.getpid()}"
    with open(tmp, "w") as f:
        f.write(name + "\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, parent / LATEST_FILE)


def _fsync_tree(root: Path) -> None:
    for path in root.iterdir():
        if not path.is_file():
            continue
        with open(path, "rb") as f:
            os.fsync(f.fileno())
    fd = os.open(root, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _complete_checkpoints(base: Path) -> list[Path]:
    """Complete checkpoints under `base`, oldest first (by saved step, then name)."""
    found = []
    if not base.is_dir():
        return []
    for path in base.iterdir():
        state = path / STATE_FILE
        if path.name.startswith(".") or not state.is_file():
            continue
        try:
            step = int(json.loads(state.read_text())["step"])
        except (ValueError, KeyError, TypeError):
            continue
        found.append((step, path.name, path))
    return [path for _, _, path in sorted(found)]


def _prune(parent: Path, keep_last: int, keep: str) -> None:
    complete = _complete_checkpoints(parent)
    for path in complete[:-keep_last]:
        if path.name != keep:
            shutil.rmtree(path, ignore_errors=True)
