"""Learner checkpoints, of a single-rank learner and of a sharded (FSDP2) one: a complete
Hugging Face model directory plus optimizer and run state.

Layout under a run directory:

    <run_dir>/checkpoints/
        step_00000200/              a complete HF model dir (transformers and vLLM load it as is)
            config.json  generation_config.json  model.safetensors (or shards + index)
            tokenizer.json  tokenizer_config.json  special_tokens_map.json ...
            optimizer.pt            single rank: torch.save(optimizer.state_dict()), loaded
                                    weights_only
            dcp/                    sharded: model and optimizer state, one file per rank plus
                                    metadata (torch.distributed.checkpoint); loads at any world size
            state.json              {"policy_version": ..., "step": ..., anything else given;
                                    sharded: "world"}
        latest                      text file: the name of the newest complete checkpoint

Writes are atomic, for both kinds through one `atomic_dir` (asyncrl/files.py): everything goes
into a `.tmp-*` directory next to the target, fsynced and renamed into place only when
complete; `latest` is replaced (write + fsync + rename) afterwards. A crash leaves either the
previous checkpoint or the new one, never half of one; stray `.tmp-*` directories are ignored by
`latest_checkpoint`. Re-saving an existing directory replaces it.

Single rank (`save_checkpoint`): weights are written by `model.save_pretrained` (safetensors;
tied weights are stored once); a caller holding a gathered full state dict passes it as
`model_state_dict`. `load_checkpoint` loads full tensors into an unsharded model; the optimizer
state it restores is the one saved.

Sharded (`save_sharded`, collective): every rank writes its own shards into the same `.tmp-*`
directory (a shared file system across nodes); rank 0 adds the consolidated HF export (gathered
parameter by parameter onto its CPU), the tokenizer and state.json, then renames the directory
into place and moves `latest`. `load_sharded` restores a `dcp/` checkpoint into a model that is
sharded over any number of ranks, or not sharded at all (a single-rank learner resuming a run
trained on several).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from safetensors.torch import load_file
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_state_dict,
)

from asyncrl.files import atomic_dir, replace_text

STATE_FILE = "state.json"
OPTIMIZER_FILE = "optimizer.pt"
LATEST_FILE = "latest"
CHECKPOINTS = "checkpoints"
DCP_DIR = "dcp"
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
    with atomic_dir(ckpt_dir) as tmp:
        model.save_pretrained(tmp, state_dict=model_state_dict)
        assert any(tmp.glob("*.safetensors")), f"save_pretrained wrote no safetensors in {tmp}"
        _copy_tokenizer(tok_files, tmp)
        if optimizer is not None:
            torch.save(optimizer.state_dict(), tmp / OPTIMIZER_FILE)
        (tmp / STATE_FILE).write_text(blob)
    _point_latest(ckpt_dir, keep_last)
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


def _copy_tokenizer(files: list[Path], into: Path) -> None:
    for src in files:
        shutil.copy2(src, into / src.name)


def _point_latest(ckpt_dir: Path, keep_last: int) -> None:
    """Move `latest` to the checkpoint just written; keep only the newest `keep_last`."""
    replace_text(ckpt_dir.parent / LATEST_FILE, ckpt_dir.name + "\n", fsync=True)
    if keep_last:
        _prune(ckpt_dir.parent, keep_last, keep=ckpt_dir.name)


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


# --- a sharded (FSDP2) learner's checkpoints --------------------------------------------------


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def save_sharded(
    ckpt_dir: str | Path,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    state: dict[str, Any],
    tokenizer_dir: str | Path | None,
    *,
    rank: int,
    keep_last: int = 0,
) -> Path:
    """Collective: every rank calls it. Returns the checkpoint's path.

    Every rank writes its dcp/ shards into one temporary directory of a fixed name (so all
    ranks find it); rank 0 made it and, after the shards, adds the rest and renames it into
    place.
    """
    ckpt_dir = Path(ckpt_dir)
    tmp = ckpt_dir.parent / f".tmp-{ckpt_dir.name}"
    if rank == 0:
        blob = _state_json(state)
        tok_files = _tokenizer_files(tokenizer_dir)
        with atomic_dir(ckpt_dir, tmp):
            _save_shards(model, optimizer, tmp, rank, blob, tok_files)
        _point_latest(ckpt_dir, keep_last)
    else:
        _save_shards(model, optimizer, tmp, rank, "", [])
    _barrier()
    return ckpt_dir


def _save_shards(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    tmp: Path,
    rank: int,
    blob: str,
    tok_files: list[Path],
) -> None:
    """Every rank: its dcp/ shards into `tmp`; rank 0 also the HF export, tokenizer and state."""
    _barrier()  # rank 0 has made `tmp`
    model_sd, optim_sd = get_state_dict(model, optimizer)
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=str(tmp / DCP_DIR))
    full = get_model_state_dict(
        model, options=StateDictOptions(full_state_dict=True, cpu_offload=True)
    )
    if rank == 0:
        model.save_pretrained(tmp, state_dict=full)
        _copy_tokenizer(tok_files, tmp)
        (tmp / STATE_FILE).write_text(blob)
    del full


def is_sharded(ckpt_dir: str | Path) -> bool:
    """True when the checkpoint holds a `dcp/` state (written by a sharded learner)."""
    return (Path(ckpt_dir) / DCP_DIR / ".metadata").is_file()


def load_sharded(
    ckpt_dir: str | Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None
) -> dict[str, Any]:
    """Collective when distributed: restore model (and optimizer) state; return state.json."""
    ckpt_dir = Path(ckpt_dir)
    if not is_sharded(ckpt_dir):
        raise ValueError(f"ckpt_dir: {ckpt_dir} holds no {DCP_DIR}/ state")
    if optimizer is not None:
        _init_optimizer_state(optimizer)
    if optimizer is None:
        model_sd = get_model_state_dict(model)
        dcp.load({"model": model_sd}, checkpoint_id=str(ckpt_dir / DCP_DIR))
        set_state_dict(model, [], model_state_dict=model_sd, optim_state_dict={})
    else:
        model_sd, optim_sd = get_state_dict(model, optimizer)
        target = {"model": model_sd, "optim": optim_sd}
        dcp.load(target, checkpoint_id=str(ckpt_dir / DCP_DIR))
        set_state_dict(
            model, optimizer, model_state_dict=target["model"], optim_state_dict=target["optim"]
        )
    return json.loads((ckpt_dir / STATE_FILE).read_text())


def _init_optimizer_state(optimizer: torch.optim.Optimizer) -> None:
    """Give every parameter its optimizer state (AdamW makes it lazily at the first step), so
    that the load has tensors of the right shape and sharding to fill: one step with zero
    gradients and a zero learning rate, which leaves the parameters as they are."""
    saved = [group["lr"] for group in optimizer.param_groups]
    for group in optimizer.param_groups:
        group["lr"] = 0.0
        for p in group["params"]:
            p.grad = torch.zeros_like(p)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    for group, lr in zip(optimizer.param_groups, saved, strict=True):
        group["lr"] = lr
