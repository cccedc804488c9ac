"""Hub-ready folders and uploads: weights, remote code, tokenizer and the ResFormer model card in one commit.

Stock `model.push_to_hub()` also works (and uploads the remote code), but it writes the Hub's existing card or a
generic one; these helpers write the ResFormer card with the model's own λ table.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from huggingface_hub import CommitInfo, CommitOperationAdd, HfApi

from .model_card import write_model_card
from .modeling_resformer import ResFormerPreTrainedModel
from .registration import full_auto_map


def save_for_hub(
    model: ResFormerPreTrainedModel,
    save_directory: str | os.PathLike,
    *,
    tokenizer: Any = None,
    base_model: str | None = None,
    init: str | None = None,
    datasets: str | Sequence[str] | None = None,
    training: Mapping[str, Any] | None = None,
    license: str | None = None,
    model_id: str | None = None,
) -> Path:
    """Write safetensors weights, config with a full `auto_map`, the remote-code files, `generation_config.json`, the
    tokenizer (when given) and `README.md` into `save_directory`; returns the folder."""
    if not isinstance(model, ResFormerPreTrainedModel):
        raise TypeError(
            f"model must be a ResFormer model, got {type(model).__name__}; convert a Llama checkpoint first with "
            "resformer_hf.conversion.convert_llama_checkpoint."
        )
    directory = Path(save_directory)
    model.config.auto_map = {**full_auto_map(), **(getattr(model.config, "auto_map", None) or {})}
    model.save_pretrained(directory)
    if tokenizer is not None:
        tokenizer.save_pretrained(directory)
    write_model_card(
        directory,
        model.config,
        base_model=base_model,
        init=init,
        lambdas=model.value_residual_lambdas(),
        datasets=datasets,
        training=training,
        license=license,
        model_id=model_id,
    )
    return directory


def upload_folder_to_hub(
    folder: str | os.PathLike,
    repo_id: str,
    *,
    private: bool | None = None,
    token: str | bool | None = None,
    commit_message: str = "Upload ResFormer model",
    create_pr: bool = False,
) -> CommitInfo:
    """Create `repo_id` if needed and upload every file of `folder` in one commit (as transformers' push does)."""
    api = HfApi()
    repo_id = api.create_repo(repo_id, private=private, token=token, exist_ok=True).repo_id
    root = Path(folder)
    operations = [
        CommitOperationAdd(path_in_repo=path.relative_to(root).as_posix(), path_or_fileobj=str(path))
        for path in sorted(root.rglob("*"))
        if path.is_file() and "__pycache__" not in path.parts and ".git" not in path.parts
    ]
    return api.create_commit(
        repo_id=repo_id, operations=operations, commit_message=commit_message, token=token, create_pr=create_pr
    )


def push_to_hub(
    model: ResFormerPreTrainedModel,
    repo_id: str,
    *,
    tokenizer: Any = None,
    private: bool | None = None,
    token: str | bool | None = None,
    commit_message: str = "Upload ResFormer model",
    create_pr: bool = False,
    **card: Any,
) -> CommitInfo:
    """`save_for_hub` into a temporary folder, then `upload_folder_to_hub`. `card` takes `write_model_card`'s
    keyword arguments; `model_id` defaults to `repo_id`."""
    card.setdefault("model_id", repo_id)
    with tempfile.TemporaryDirectory() as folder:
        save_for_hub(model, folder, tokenizer=tokenizer, **card)
        return upload_folder_to_hub(
            folder, repo_id, private=private, token=token, commit_message=commit_message, create_pr=create_pr
        )


__all__ = ["full_auto_map", "push_to_hub", "save_for_hub", "upload_folder_to_hub"]
