"""Value embeddings: a layer with a table attends over `V'' = V' + g·VE[token]`, before the cache update.

`V'` is what the layer attends over without a table (a receiving layer's mix, else its own `v_proj` output); layer 0
still hands on its plain `v_proj` output as V_0. `VE` is a table `[vocab, H_kv·D]` indexed by the token id, `g` one
gate per token and kv head from the layer's normalised input x̂. Every cache stores V'' as it stores V.

Anchors: modded-nanogpt's `train_gpt.py` (token value embeddings added to V in layers 1, 2, 8, 9, 10 of 11 — `ve =
[None, ve[0], ve[1], *fillers, ve[2], ve[3], ve[4]]` — each gated by `2·σ(W·[x̂[:6], ve[:6]])`, W zero at first) and
nanochat's `nanochat/gpt.py` (`has_ve`: `i % 2 == (L − 1) % 2`, the last layer always; one `[vocab, kv_dim]` table
per such layer; `ve_gate = Linear(12, n_kv_head, bias=False)`, `v = v + 3·σ(ve_gate(x[..., :12]))·ve`, added before
the KV cache). Here: nanochat's gate input (x̂[..., :12], no bias, per kv head) and table shape, modded-nanogpt's
`2·σ` with W at zero, and tables at zero (both anchors start them random): a fresh gate is exactly 1, so a model with
tables starts at the outputs of the same model without them (a converted Llama at the Llama's) and the tables get
the values' gradient at the first step.

Imports only torch, transformers and sibling files (copied next to `config.json` for `trust_remote_code`).
"""

from __future__ import annotations

import sys

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from ._compat import ALL_PARALLEL_STYLES
from .variants import MIX, PLAIN, VARIANTS

FIELD = "value_embeddings"
#: Gate input: the first channels of the layer's normalised input (nanochat's `ve_gate_channels = 12`)
GATE_CHANNELS = 12
NEEDS_INPUT_IDS = (
    "This model has value embeddings (config.value_embeddings): each of their layers adds a row of its table indexed "
    "by the token id to its values, so it needs input_ids; inputs_embeds alone cannot give them. Pass input_ids "
    "(generate(): input_ids, not inputs_embeds; vLLM: start the engine without enable_prompt_embeds, with which "
    "vLLM hands the model only embeddings, for every request)."
)


def alternating(num_layers: int) -> list[int]:
    """nanochat's `has_ve`: every other layer, counted back from the last (which always has a table)."""
    return [layer for layer in range(num_layers) if layer % 2 == (num_layers - 1) % 2]


def u_net(num_layers: int) -> list[int]:
    """modded-nanogpt's shape: layers 1 and 2 and the last three (1, 2, 8, 9, 10 of 11), never layer 0; the tables
    there are its U-Net pairs' ends. With fewer than 6 layers the two ends overlap and each layer is listed once."""
    return sorted({1, 2, num_layers - 3, num_layers - 2, num_layers - 1} & set(range(1, num_layers)))


LAYOUTS = {"alternating": alternating, "u_net": u_net}


def combinable_variants() -> tuple[str, ...]:
    """Variants whose layers may have tables: each layer attends over values of its own v_proj, plain or mixed
    with V_0 (roles "plain" and "mix" of the registry, DenseFormer's depth averages aside)."""
    return tuple(name for name, spec in VARIANTS.items()
                 if spec.role in (PLAIN, MIX) and not spec.depth_weighted_average)


def value_embedding_layers(config) -> tuple[int, ...]:
    """The sorted layers with a table, or a `ValueError` naming `value_embeddings` and what is allowed."""
    chosen, last = getattr(config, FIELD, None), config.num_hidden_layers - 1
    if chosen is None or (isinstance(chosen, (list, tuple)) and not chosen):
        return ()
    if isinstance(chosen, str):
        if chosen not in LAYOUTS:
            raise ValueError(f"{FIELD}={chosen!r} is not a layout; use one of {', '.join(LAYOUTS)}, a list of layer "
                             f"indices in 0..{last}, or None (no tables).")
        layers = LAYOUTS[chosen](config.num_hidden_layers)
        if not layers:
            raise ValueError(f"{FIELD}={chosen!r} gives no layer for num_hidden_layers={last + 1}; list the layers.")
    elif isinstance(chosen, (list, tuple)):
        layers = list(chosen)
        bad = [i for i in layers if isinstance(i, bool) or not isinstance(i, int) or not 0 <= i <= last]
        if bad:
            raise ValueError(f"{FIELD} has {bad}: each entry must be a layer index in 0..{last} (0-based).")
        if len(set(layers)) != len(layers):
            raise ValueError(f"{FIELD}={layers} lists a layer twice; give each index once.")
    else:
        raise ValueError(f"{FIELD}={chosen!r} must be None, a list of layer indices or one of {', '.join(LAYOUTS)}.")
    if config.value_residual not in combinable_variants():
        raise ValueError(
            f"{FIELD} does not combine with value_residual={config.value_residual!r} (its layers do not attend over "
            f"values of their own v_proj, or its cache stores V_0 once); use one of: "
            f"{', '.join(combinable_variants())}."
        )
    shared = sorted(set(layers) & set(config.layers_reading_shared_keys_values))
    if shared:
        raise ValueError(f"{FIELD} gives tables to layers {shared}, which attend over an earlier layer's K and V "
                         "(cross_layer_attention) and have no values of their own; leave them out.")
    return tuple(sorted(layers))


def need_token_ids(config, input_ids: torch.Tensor | None) -> None:
    """Refuse a forward pass without token ids (`inputs_embeds` alone) when the model has tables."""
    if input_ids is None and config.value_embedding_layers:
        raise ValueError(NEEDS_INPUT_IDS)


def refuse_embeddings_only_engine(config) -> None:
    """Refuse at engine start, not at its first request, a vLLM engine that hands the model embeddings only (prompt
    embeddings, multimodal front ends: vLLM then drops input_ids). Looked up: remote code does not import vLLM."""
    vllm_config = sys.modules.get("vllm.config") if config._attn_implementation == "vllm" else None
    engine = vllm_config.get_current_vllm_config_or_none() if vllm_config is not None else None
    if engine is not None and (engine.model_config.enable_prompt_embeds or engine.model_config.is_multimodal_model):
        raise ValueError(NEEDS_INPUT_IDS)


class ValueEmbedding(nn.Embedding):
    """A layer's table `[vocab, H_kv·D]`: a row of values per token id, un-repeated kv heads; zero at first."""


class ValueEmbeddingGate(nn.Linear):
    """Logits of the table's gate, one per kv head, from x̂[..., :GATE_CHANNELS]; the gate is `2·σ(logits)`. No
    bias; W zero at first, so the gate starts at exactly 1 and learns at once (its gradient is ∝ the table row)."""


def attach_value_embedding(attention: nn.Module, config, layer_idx: int) -> None:
    """Give attention layer `layer_idx` its table and gate when `config.value_embedding_layers` lists it; read once,
    as Gemma3n's attention reads `is_kv_shared_layer`. Kept in the model's dtype (a table is vocab-sized)."""
    attention.has_value_embedding = layer_idx in config.value_embedding_layers
    if attention.has_value_embedding:
        refuse_embeddings_only_engine(config)
        kv_dim = config.num_key_value_heads * attention.head_dim
        # read here, not from the gate: vLLM swaps the gate for its own linear, which has no `in_features`
        attention.value_embedding_channels = min(GATE_CHANNELS, config.hidden_size)
        attention.value_embedding = ValueEmbedding(config.vocab_size, kv_dim)
        attention.value_embedding_gate = ValueEmbeddingGate(attention.value_embedding_channels,
                                                            config.num_key_value_heads, bias=False)


def add_value_embedding(attention: nn.Module, value_states: torch.Tensor, hidden_states: torch.Tensor,
                        token_ids: torch.Tensor | None) -> torch.Tensor:
    """`V' + 2·σ(W x̂[..., :C])·VE[token]` per kv head, from V' [B, H_kv, T, D] (H_kv: this rank's heads under tensor
    parallelism), x̂ [B, T, hidden] and the token ids [B, T], in a layer that has a table. Out of place:
    layer 0's V' may be a view of the V_0 it hands on. With gradient the rows are looked up again in backward (a
    checkpoint around the lookup, so every engine's module hooks see it) instead of kept: kept, they would be a
    V-sized tensor a layer beyond what Llama saves."""
    if token_ids is None:
        raise ValueError(NEEDS_INPUT_IDS)
    gate = torch.sigmoid(attention.value_embedding_gate(hidden_states[..., : attention.value_embedding_channels]))
    if torch.is_grad_enabled():
        gated = checkpoint(gated_rows, attention.value_embedding, gate, token_ids, value_states.dtype,
                           attention.head_dim, use_reentrant=False, preserve_rng_state=False)
    else:
        gated = gated_rows(attention.value_embedding, gate, token_ids, value_states.dtype, attention.head_dim)
    return torch.add(value_states, gated, alpha=2.0)


def gated_rows(table: nn.Module, gate: torch.Tensor, token_ids: torch.Tensor, dtype: torch.dtype,
               head_dim: int) -> torch.Tensor:
    """σ(W x̂)·VE[token] [B, H_kv, T, D] from the gate [B, T, H_kv] and the token ids [B, T]. vLLM's tensor parallel
    swaps the table for its VocabParallelEmbedding (split by vocabulary; a lookup is all-reduced to every rank's kv
    heads): a rank keeps its own heads, those of its v_proj shard."""
    batch, length, heads = gate.shape
    rows = table(token_ids)
    if rows.shape[-1] > heads * head_dim:  # vLLM's tensor parallel
        rows = rows.unflatten(-1, (-1, heads * head_dim))[..., table.tp_rank, :]
    rows = rows.view(batch, length, heads, head_dim).transpose(1, 2)
    return gate.transpose(1, 2).unsqueeze(-1).to(dtype) * rows.to(dtype)


try:  # transformers 5.19 has no EmbeddingParallel: there tensor parallel cannot split a model with tables
    from transformers.distributed.tensor_parallel import EmbeddingParallel
except ImportError:
    EmbeddingParallel = None
if ALL_PARALLEL_STYLES is not None and torch.distributed.is_available() and EmbeddingParallel is not None:
    from torch.distributed.tensor import DTensor

    class ValueEmbeddingByKvHead(EmbeddingParallel):
        """Tensor parallel: a table split along its columns, which are kv heads as v_proj's outputs are (colwise),
        so each rank looks up its own heads' values and keeps them local (no gather, no all-reduce). `embed_tokens`
        is split by vocabulary instead, which would need an all-reduce per layer and then a slice per rank."""

        def transform_output_post_forward(self, module, output, mesh):
            return output.to_local() if isinstance(output, DTensor) else output

    ALL_PARALLEL_STYLES.register("value_embedding_by_kv_head", ValueEmbeddingByKvHead(shard_dim=1))

#: Tensor-parallel plan of the tables and gates (split by kv head); in the plan of models with tables only.
#: Gate first: vLLM gives a linear the first pattern that `re.match`es its name, and the table's matches the gate's.
VALUE_EMBEDDING_TP_PLAN = {"layers.*.self_attn.value_embedding_gate": "colwise",
                           "layers.*.self_attn.value_embedding": "value_embedding_by_kv_head"}
#: Modules that start at zero (`_init_weights`): a checkpoint without tables loads as the model without them
VALUE_EMBEDDING_MODULES = (ValueEmbedding, ValueEmbeddingGate)

__all__ = ["LAYOUTS", "NEEDS_INPUT_IDS", "VALUE_EMBEDDING_MODULES", "VALUE_EMBEDDING_TP_PLAN", "ValueEmbedding",
           "ValueEmbeddingGate", "add_value_embedding", "attach_value_embedding", "need_token_ids",
           "value_embedding_layers"]
