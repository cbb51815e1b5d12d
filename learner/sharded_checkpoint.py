"""Checkpoints of a sharded (FSDP2) learner: torch.distributed.checkpoint plus an HF export.

Layout (beside the single-rank layout of learner/checkpoint.py, in the same `checkpoints/`):

    step_00000200/
        dcp/                    model and optimizer state, one file per rank plus metadata
                                (torch.distributed.checkpoint); loads at any world size
        config.json  model.safetensors ...  tokenizer files
                                the consolidated Hugging Face export (transformers and vLLM load
                                it as is), gathered parameter by parameter onto rank 0's CPU
        state.json              {"policy_version", "step", "world"}

Every rank writes its own shards into the same directory (a shared file system across nodes);
rank 0 writes the rest, then renames the directory into place and moves `latest`, so a crash
leaves the previous checkpoint or the new one, never half of one. `load_sharded` restores a
`dcp/` checkpoint into a model that is sharded over any number of ranks, or not sharded at all
(a single-rank learner resuming a run trained on several).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_state_dict,
)

from learner.checkpoint import (
    STATE_FILE,
    _fsync_tree,
    _prune,
    _replace_dir,
    _state_json,
    _tokenizer_files,
    _write_latest,
)

DCP_DIR = "dcp"


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
    """Collective: every rank calls it. Returns the checkpoint's path."""
    ckpt_dir = Path(ckpt_dir)
    tmp = ckpt_dir.parent / f".tmp-{ckpt_dir.name}"
    if rank == 0:
        blob = _state_json(state)
        tok_files = _tokenizer_files(tokenizer_dir)
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    _barrier()
    model_sd, optim_sd = get_state_dict(model, optimizer)
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=str(tmp / DCP_DIR))
    full = get_model_state_dict(
        model, options=StateDictOptions(full_state_dict=True, cpu_offload=True)
    )
    if rank == 0:
        try:
            model.save_pretrained(tmp, state_dict=full)
            for src in tok_files:
                shutil.copy2(src, tmp / src.name)
            (tmp / STATE_FILE).write_text(blob)
            _fsync_tree(tmp)
            _replace_dir(tmp, ckpt_dir)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        _write_latest(ckpt_dir.parent, ckpt_dir.name)
        if keep_last:
            _prune(ckpt_dir.parent, keep_last, keep=ckpt_dir.name)
    del full
    _barrier()
    return ckpt_dir


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
