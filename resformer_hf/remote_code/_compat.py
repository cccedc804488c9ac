"""Every difference between the transformers releases ResFormer supports, in one place.

The modeling code is written against the newest release (5.24: the KV cache is the argument and output field `cache`,
`Cache.update(..., kwargs=)`); this module maps those names onto older releases (5.19-5.23: `past_key_values`), the
way PEFT keeps its version checks in one file. Nothing else in the package compares transformers versions. Features
are detected from transformers itself where possible, so a backport in a patch release needs no change here.

Imports only transformers: it ships with the remote code (`trust_remote_code=True` without the plugin) and is the
first sibling the configuration imports, so an unsupported transformers is reported before anything else fails.
"""

from __future__ import annotations

import functools
import inspect
import re
import warnings
from collections.abc import Callable
from typing import Any

import transformers

#: The releases this code base is tested on (docs/supported-releases.md). To support the next minor
#: release: run the suite on it, then raise `NEWEST_TESTED` and setup.cfg's upper bound together.
OLDEST_SUPPORTED = "5.19"
NEWEST_TESTED = "5.24"
TRANSFORMERS_VERSION = transformers.__version__


def major_minor(version: str) -> tuple[int, int]:
    major, minor = re.match(r"(\d+)\.(\d+)", version).groups()
    return int(major), int(minor)


def supported_range() -> str:
    """The pip requirement that admits exactly the tested releases."""
    major, minor = major_minor(NEWEST_TESTED)
    return f"transformers>={OLDEST_SUPPORTED},<{major}.{minor + 1}"


if major_minor(TRANSFORMERS_VERSION) < major_minor(OLDEST_SUPPORTED):
    raise ImportError(
        f"ResFormer needs transformers >= {OLDEST_SUPPORTED}, found {TRANSFORMERS_VERSION}: "
        f"pip install -U '{supported_range()}'"
    )


class UntestedTransformersWarning(UserWarning):
    """transformers is newer than every release ResFormer was tested on."""


_warned_untested = False


def warn_if_untested() -> None:
    """Say once per process that this transformers was never tested, what was, and how to pin."""
    global _warned_untested
    if _warned_untested or major_minor(TRANSFORMERS_VERSION) <= major_minor(NEWEST_TESTED):
        return
    _warned_untested = True
    warnings.warn(
        f"resformer-hf is tested on transformers {OLDEST_SUPPORTED} to {NEWEST_TESTED}.x, found "
        f"{TRANSFORMERS_VERSION}; check cached generation before relying on it, or pin: pip install "
        f"'{supported_range()}'",
        UntestedTransformersWarning,
        stacklevel=3,
    )


warn_if_untested()

# ---- the KV cache's name (5.24 renamed `past_key_values` to `cache` everywhere) ------------------------------------

from transformers.cache_utils import Cache  # noqa: E402  (after the version check)
from transformers.masking_utils import create_causal_mask as _create_causal_mask  # noqa: E402
from transformers.masking_utils import (  # noqa: E402
    create_sliding_window_causal_mask as _create_sliding_window_causal_mask,
)
from transformers.modeling_layers import GradientCheckpointingLayer as _GradientCheckpointingLayer  # noqa: E402
from transformers.models.llama.modeling_llama import LlamaModel  # noqa: E402
from transformers.utils import is_torchdynamo_compiling, logging  # noqa: E402

logger = logging.get_logger(__name__)

#: What this release calls the KV cache in forward arguments, model outputs and `generate()`'s model kwargs.
CACHE_ARGUMENT = "cache" if "cache" in inspect.signature(LlamaModel.forward).parameters else "past_key_values"
CACHE_RENAMED = CACHE_ARGUMENT == "cache"

#: Names older code (transformers 4.x, other models' remote code) gives the KV cache. None of them reaches a ResFormer
#: layer on a supported release, so receiving one means the caller expects a cache to be used that would be ignored.
FOREIGN_CACHE_NAMES = ("past_key_values", "past_key_value", "cache_params", "layer_past", "key_value_cache")


def accepts_cache(forward: Callable) -> Callable:
    """Decorator for a `forward(..., cache=...)` written with 5.24's name that also takes the cache as
    `past_key_values`, the official name before 5.24 (`generate()` and the Llama heads pass it).

    A cache is never dropped: `past_key_values=C` next to `cache=None` (what PEFT 0.21's prefix tuning passes on
    5.24, where transformers' own `deprecate_kwarg` would keep `cache=None` and compute without C) uses C, and two
    different caches are refused. On 5.24 the old name warns as `deprecate_kwarg` does (FutureWarning, not while
    compiling); the plain wrapper also keeps `torch.compile(fullgraph=True)` traceable on older torch, which cannot
    trace `deprecate_kwarg`'s signature inspection.
    """

    @functools.wraps(forward)
    def renamed(*args: Any, **kwargs: Any):
        if "past_key_values" in kwargs:  # the Llama heads pass `past_key_values=None` when given `cache=...`
            legacy = kwargs.pop("past_key_values")
            current = kwargs.get("cache")
            if legacy is not None and current is not None and current is not legacy:
                raise ValueError(
                    "Pass the KV cache once, as `cache` or as `past_key_values`, not both: one of the two would be "
                    "ignored."
                )
            if legacy is not None:
                if CACHE_RENAMED and not is_torchdynamo_compiling():
                    warnings.warn(
                        "`past_key_values` is deprecated (transformers 5.24 renamed it); use `cache` instead.",
                        FutureWarning,
                        stacklevel=2,
                    )
                kwargs["cache"] = legacy
        return forward(*args, **kwargs)

    return renamed


def model_output(output_class: type, **fields: Any):
    """`output_class(**fields)` with the `cache` field under this release's name."""
    if not CACHE_RENAMED and "cache" in fields:
        fields["past_key_values"] = fields.pop("cache")
    return output_class(**fields)


@functools.cache
def _paged_cache_class() -> type:
    from transformers.generation.continuous_batching.cache import PagedAttentionCache

    return PagedAttentionCache


def is_paged_cache(cache: Cache | None) -> bool:
    """Whether `cache` is continuous batching's paged cache, where a cross-layer-attention consumer updates its
    producer's pages too (`paged_cache.py`)."""
    return cache is not None and isinstance(cache, _paged_cache_class())


def update_cache(cache: Cache, key_states, value_states, layer_idx: int, kwargs: dict):
    """`Cache.update` as this release's Llama attention calls it (5.24 also hands the layer the attention kwargs)."""
    if CACHE_RENAMED:
        return cache.update(key_states, value_states, layer_idx, kwargs=kwargs)
    if is_paged_cache(cache):
        # 5.19-5.23 continuous batching hands its paged cache to the attention function as the keyword `cache`
        # (which the layer's `cache` argument caught): the paged attention function updates it, with its kwargs.
        kwargs["cache"] = cache
        return key_states, value_states
    return cache.update(key_states, value_states, layer_idx)


def with_cache(cache: Cache | None) -> dict[str, Cache | None]:
    """Keyword arguments that hand `cache` to any transformers model's forward or `generate()` on this release
    (Llama's too, which ignores a cache under the other name)."""
    return {CACHE_ARGUMENT: cache}


def cache_of(output: Any) -> Cache | None:
    """The KV cache a model output carries, from this release's field."""
    return output[CACHE_ARGUMENT] if CACHE_ARGUMENT in output else None


def create_causal_mask(*, cache: Cache | None, **kwargs: Any):
    """transformers' `create_causal_mask`, whose cache argument has this release's name."""
    return _create_causal_mask(**kwargs, **{CACHE_ARGUMENT: cache})


def create_sliding_window_causal_mask(*, cache: Cache | None, **kwargs: Any):
    """transformers' `create_sliding_window_causal_mask` (the window is `config.sliding_window`), likewise."""
    return _create_sliding_window_causal_mask(**kwargs, **{CACHE_ARGUMENT: cache})


#: The mask of each of transformers' layer types.
CAUSAL_MASKS = {"full_attention": create_causal_mask, "sliding_attention": create_sliding_window_causal_mask}


def generation_cache(model_kwargs: dict) -> Cache | None:
    """The cache `generate()` prepared in its model kwargs."""
    return model_kwargs.get(CACHE_ARGUMENT)


def refuse_unread_cache(kwargs: dict, where: str) -> None:
    """Raise when a forward's `**kwargs` hold a KV cache (or a known cache name) that the model would never read.

    The model's own cache argument is a named parameter, so whatever reaches `**kwargs` flows on to the attention
    function, which ignores it: a cache there means the caller (a newer `generate()`, other code) uses a name this code
    does not know, and computing without it would silently give wrong tokens.
    """
    for name, value in kwargs.items():
        if isinstance(value, Cache) or (name in FOREIGN_CACHE_NAMES and value is not None):
            raise TypeError(
                f"{where} received a KV cache as `{name}`, a name it does not read; on transformers "
                f"{TRANSFORMERS_VERSION} pass it as `cache`. If a newer transformers passes it so, this plugin does "
                f"not support that release yet: pip install '{supported_range()}'."
            )


if CACHE_RENAMED:
    GradientCheckpointingLayer = _GradientCheckpointingLayer
else:

    class GradientCheckpointingLayer(_GradientCheckpointingLayer):
        """Older releases clear only a `past_key_values` argument under gradient checkpointing (the replay in backward
        would write the cache twice); the layers here take it as `cache`, which is cleared the same way."""

        def __call__(self, *args: Any, **kwargs: Any):
            if (
                self.gradient_checkpointing and self.training and not self._can_checkpoint_with_cache
                and kwargs.get("cache") is not None
            ):
                kwargs["cache"] = None
                message = f"Caching is incompatible with gradient checkpointing in {type(self).__name__}."
                logger.warning_once(message + " Setting `cache=None`.")
            return super().__call__(*args, **kwargs)


# ---- features that appeared within the supported range ------------------------------------------------------------

try:  # 5.22 moved the registry of tensor-parallel styles out of tensor_parallel.py
    from transformers.distributed.parallel_utils import ALL_PARALLEL_STYLES
except ImportError:
    try:
        from transformers.distributed.tensor_parallel import ALL_PARALLEL_STYLES
    except ImportError:  # no torch.distributed
        ALL_PARALLEL_STYLES = None


__all__ = [
    "ALL_PARALLEL_STYLES",
    "CACHE_ARGUMENT",
    "CAUSAL_MASKS",
    "CACHE_RENAMED",
    "GradientCheckpointingLayer",
    "NEWEST_TESTED",
    "OLDEST_SUPPORTED",
    "TRANSFORMERS_VERSION",
    "UntestedTransformersWarning",
    "accepts_cache",
    "create_causal_mask",
    "create_sliding_window_causal_mask",
    "generation_cache",
    "model_output",
    "refuse_unread_cache",
    "supported_range",
    "update_cache",
    "with_cache",
    "cache_of",
]
