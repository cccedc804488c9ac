"""Hub-ready folders and uploads: weights, remote code, tokenizer and the ResFormer model card in one commit.

`finish_hub_folder` is the one place that makes a folder publishable (the remote-code files, `config.json` with every
Auto class in `auto_map` and `use_cache: true`, a `generation_config.json` that says how the model samples, the model
card); the converter, the quickstart and `save_for_hub` all
use it. Stock `model.push_to_hub()` also works (and uploads the remote code), but it writes the Hub's existing card
or a generic one; `push_with_card` writes the ResFormer card with the model's own λ table.
"""

from __future__ import annotations

import copy
import os
import tempfile
import warnings
from pathlib import Path
from typing import TYPE_CHECKING, Any

from huggingface_hub import CommitInfo, CommitOperationAdd, HfApi
from huggingface_hub.utils import DEFAULT_IGNORE_PATTERNS, filter_repo_objects
from transformers import GenerationConfig
from transformers.dynamic_module_utils import custom_object_save

from ..registration import full_auto_map
from ..remote_code.configuration_resformer import ResFormerConfig
from ..remote_code.modeling_resformer import ResFormerForCausalLM, ResFormerPreTrainedModel
from . import model_card
from .model_card import CardFacts, check_card_facts
from .refresh_code import refresh_remote_code

if TYPE_CHECKING:
    from typing_extensions import Unpack

#: How a folder's model samples where its generation_config leaves `do_sample` unset: OpenAI's defaults (temperature
#: 1, the whole distribution: no top-k, no nucleus). Left unset, each reader fills it in its own way: `generate()` and
#: `transformers serve` decode greedily, vLLM samples at temperature 1, and `generate()` samples with top-k 50.
SAMPLING_DEFAULTS = {"do_sample": True, "temperature": 1.0, "top_p": 1.0, "top_k": 0}


def finish_hub_folder(
    directory: str | os.PathLike, config: ResFormerConfig, *, lambdas: Any = None, **facts: Unpack[CardFacts]
) -> Path:
    """Make a folder that holds the weights publishable: copy the remote-code files (so it loads with
    `trust_remote_code=True` and no plugin), write `config.json` with a full `auto_map` and `use_cache: true` (a
    Trainer may have switched the cache off on the model it trained), and the model card (`write_model_card`'s
    arguments). `config` itself is not changed. Returns the folder."""
    check_card_facts(facts)
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    custom_object_save(ResFormerForCausalLM, directory)  # modeling_resformer.py and every file it imports
    published = copy.deepcopy(config)
    published.auto_map = {**full_auto_map(), **(getattr(config, "auto_map", None) or {})}
    published.use_cache = True
    published.save_pretrained(directory)
    write_sampling(directory, published)
    model_card.write_model_card(directory, published, lambdas=lambdas, **facts)
    return directory


def write_sampling(directory: str | os.PathLike, config: ResFormerConfig) -> GenerationConfig:
    """Make `directory`'s generation_config.json (the model's, a converted source's, or one from `config`'s token ids
    if there is none) say how the model samples: `SAMPLING_DEFAULTS` where it leaves `do_sample` unset. One that sets
    `do_sample` (a source's own sampling, a greedy model) is left as it is, byte for byte."""
    directory = Path(directory)
    if (directory / "generation_config.json").is_file():
        generation = GenerationConfig.from_pretrained(directory)
        if generation.do_sample is not None:
            return generation
    else:
        generation = GenerationConfig.from_model_config(config)
    generation.update(**SAMPLING_DEFAULTS)
    generation._from_model_config = False  # it says more than the model config's token ids now
    generation.save_pretrained(directory)
    return generation


def save_for_hub(
    model: ResFormerPreTrainedModel,
    save_directory: str | os.PathLike,
    *,
    tokenizer: Any = None,
    **facts: Unpack[CardFacts],
) -> Path:
    """Write safetensors weights, `generation_config.json` and the tokenizer (when given) into `save_directory`,
    then `finish_hub_folder` it (remote code, `config.json`, `README.md` with the model's own λ); returns the
    folder."""
    if not isinstance(model, ResFormerPreTrainedModel):
        raise TypeError(
            f"model must be a ResFormer model, got {type(model).__name__}; convert a Llama checkpoint first with "
            "resformer_hf.conversion.convert_llama_checkpoint."
        )
    check_card_facts(facts)
    directory = Path(save_directory)
    model.save_pretrained(directory)
    if tokenizer is not None:
        tokenizer.save_pretrained(directory)
    return finish_hub_folder(directory, model.config, lambdas=model.value_residual_lambdas(), **facts)

# Beyond huggingface_hub's defaults: bytecode, and `--refresh-code`'s own files (staging files, kept originals and
# the journal: all `.<name>.tmp`, see `file_transaction`).
_NOT_UPLOADED = ("__pycache__/*", "*/__pycache__/*", ".*.tmp", "*/.*.tmp")


def upload_folder_to_hub(
    folder: str | os.PathLike,
    repo_id: str,
    *,
    private: bool | None = None,
    token: str | bool | None = None,
    commit_message: str = "Upload ResFormer model",
    create_pr: bool = False,
) -> CommitInfo:
    """Create `repo_id` if needed and upload the files of `folder` in one commit (as transformers' push does),
    skipping what `hf upload` skips (huggingface_hub's `DEFAULT_IGNORE_PATTERNS`: `.git/`, `.cache/huggingface/`),
    bytecode, and the staging files an interrupted `--refresh-code` may leave."""
    api = HfApi()
    repo_id = api.create_repo(repo_id, private=private, token=token, exist_ok=True).repo_id
    root = Path(folder)
    files = sorted(path.relative_to(root).as_posix() for path in root.rglob("*") if path.is_file())
    ignored = [*DEFAULT_IGNORE_PATTERNS, *_NOT_UPLOADED]
    operations = [
        CommitOperationAdd(path_in_repo=name, path_or_fileobj=str(root / name))
        for name in filter_repo_objects(files, ignore_patterns=ignored)
    ]
    return api.create_commit(
        repo_id=repo_id, operations=operations, commit_message=commit_message, token=token, create_pr=create_pr
    )


def push_with_card(
    model: ResFormerPreTrainedModel,
    repo_id: str,
    *,
    tokenizer: Any = None,
    private: bool | None = None,
    token: str | bool | None = None,
    commit_message: str = "Upload ResFormer model",
    create_pr: bool = False,
    **facts: Unpack[CardFacts],
) -> CommitInfo:
    """`save_for_hub` into a temporary folder, then `upload_folder_to_hub`; `model_id` defaults to `repo_id`."""
    facts.setdefault("model_id", repo_id)
    with tempfile.TemporaryDirectory() as folder:
        save_for_hub(model, folder, tokenizer=tokenizer, **facts)
        return upload_folder_to_hub(
            folder, repo_id, private=private, token=token, commit_message=commit_message, create_pr=create_pr
        )


def push_to_hub(model: ResFormerPreTrainedModel, repo_id: str, **kwargs: Any) -> CommitInfo:
    """Deprecated name of `push_with_card` (it shadowed `PreTrainedModel.push_to_hub`, which behaves differently)."""
    warnings.warn(
        "resformer_hf.hub.push_to_hub is deprecated and will be removed; use resformer_hf.hub.push_with_card (same "
        "arguments). model.push_to_hub() is transformers' own upload, without the ResFormer card.",
        FutureWarning,
        stacklevel=2,
    )
    return push_with_card(model, repo_id, **kwargs)


__all__ = [
    "SAMPLING_DEFAULTS",
    "finish_hub_folder",
    "full_auto_map",
    "push_to_hub",
    "push_with_card",
    "refresh_remote_code",
    "save_for_hub",
    "upload_folder_to_hub",
    "write_sampling",
]
