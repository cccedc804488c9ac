"""ResFormer models: Llama's decoder with the value residual wired into attention.

Built from Llama's own blocks (MLP, RMSNorm, rotary embedding, attention interface, masks, heads); only the
attention (`attention_resformer.py`) and the decoder loop change, to carry layer 0's values to later layers.
Copied next to `config.json` for `trust_remote_code`, so it imports only torch, transformers and its sibling files.
"""

from __future__ import annotations

import torch
from torch import nn
from transformers import AutoModel
from transformers import initialization as init
from transformers.cache_utils import Cache
from transformers.conversion_mapping import register_checkpoint_conversion_mapping
from transformers.generation import GenerationMixin
from transformers.modeling_layers import (
    GenericForQuestionAnswering,
    GenericForSequenceClassification,
    GenericForTokenClassification,
)
from transformers.modeling_outputs import BaseModelOutputWithPast
from transformers.modeling_utils import PreTrainedModel
from transformers.models.auto import modeling_auto
from transformers.models.llama.modeling_llama import LlamaForCausalLM, LlamaMLP
from transformers.processing_utils import Unpack
from transformers.utils import TransformersKwargs, auto_docstring

# Internal transformers utilities (not public API), used exactly as modeling_llama.py 5.19-5.24 uses them.
from transformers.utils.generic import merge_with_config_defaults
from transformers.utils.output_capturing import OutputRecorder, capture_outputs

from ._compat import (
    CACHE_ARGUMENT,
    CAUSAL_MASKS,
    GradientCheckpointingLayer,
    accepts_cache,
    generation_cache,
    model_output,
    refuse_unread_cache,
)
from .architecture import PRE, SANDWICH, rope_by_layer_type
from .attention_resformer import ResFormerAttention, ResFormerSharedKeysValuesAttention
from .base_blocks import init_base_block, rms_norm, rotary_embedding, token_embedding
from .cache_resformer import new_dynamic_cache, share_cache_storage
from .configuration_resformer import ResFormerConfig
from .depth_weighted_average import DepthWeightedAverage
from .lambdas import ValueResidual
from .loading import (
    LAMBDA_CHECKPOINT_CONVERSIONS,
    PIPELINE_PARALLEL_UNSUPPORTED,
    CheckpointChecks,
    ParallelismHooks,
    VocabularyResizing,
    gathered_parameters,
    is_pipeline_stage,
    modules_kept_in_float32,
    register_peft_target_modules,
)
from .value_embeddings import VALUE_EMBEDDING_MODULES, need_token_ids
from .value_residual import ResidualValues, ValueGate, compute_dtype

# Checkpoints from before λ_scale became 1-D hold it as a 0-dim tensor; `from_pretrained` reshapes it on load.
register_checkpoint_conversion_mapping(ResFormerConfig.model_type, LAMBDA_CHECKPOINT_CONVERSIONS, overwrite=True)


class ResFormerDecoderLayer(GradientCheckpointingLayer):
    """Llama's decoder layer that also passes the residual values on to the next layer, with the base's norms
    (`block_norms`). The values and the layer's λ (`lambda_first`, `lambda_self`) are positional, so that reentrant
    gradient checkpointing propagates their gradients."""

    def __init__(self, config: ResFormerConfig, layer_idx: int):
        super().__init__()
        self.hidden_size = config.hidden_size
        self.layer_idx = layer_idx
        self.attention_type = config.attention_types[layer_idx]  # the mask and the RoPE this layer reads
        reads_shared = config.key_value_source_layers[layer_idx] != layer_idx
        attention = ResFormerSharedKeysValuesAttention if reads_shared else ResFormerAttention
        self.self_attn = attention(config=config, layer_idx=layer_idx)
        self.mlp = LlamaMLP(config)
        # Norms before each sublayer (Llama), on each sublayer's output before the residual add (OLMo 2), or both
        # (Gemma 3), under their checkpoints' names: Llama calls the norm before its MLP `post_attention_layernorm`,
        # a base that norms outputs gives that name to the attention output's norm and calls the MLP input's
        # `pre_feedforward_layernorm`.
        self.norms_inputs, self.norms_outputs = config.block_norms in (PRE, SANDWICH), config.block_norms != PRE
        self.input_layernorm = rms_norm(config, config.hidden_size) if self.norms_inputs else None
        self.post_attention_layernorm = rms_norm(config, config.hidden_size)
        both = self.norms_inputs and self.norms_outputs
        self.pre_feedforward_layernorm = rms_norm(config, config.hidden_size) if both else None
        self.post_feedforward_layernorm = rms_norm(config, config.hidden_size) if self.norms_outputs else None
        # Cross-layer attention: whether the next layer attends over this layer's K and V (else none are handed on)
        self.hands_on_keys_values = self.self_attn.hands_on_keys_values

    def forward(
        self, hidden_states: torch.Tensor, residual_values: ResidualValues | None, lambda_first=None, lambda_self=None,
        shared_keys: torch.Tensor | None = None, shared_values: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None, position_ids: torch.LongTensor | None = None,
        cache: Cache | None = None, use_cache: bool | None = False,
        position_embeddings: tuple[torch.Tensor, torch.Tensor] | None = None, value_embedding_ids=None,
        **kwargs: Unpack[TransformersKwargs],
    ) -> tuple[torch.Tensor, ResidualValues | None, torch.Tensor | None, torch.Tensor | None]:
        residual = hidden_states
        if self.norms_inputs:
            hidden_states = self.input_layernorm(hidden_states)
        hidden_states, _, residual_values, (shared_keys, shared_values) = self.self_attn(
            hidden_states, residual_values, lambda_first, lambda_self, attention_mask=attention_mask,
            position_ids=position_ids, cache=cache, use_cache=use_cache, position_embeddings=position_embeddings,
            shared_keys_values=(shared_keys, shared_values), value_embedding_ids=value_embedding_ids, **kwargs,
        )
        if self.norms_outputs:
            hidden_states = self.post_attention_layernorm(hidden_states)
        hidden_states = residual + hidden_states

        residual = hidden_states
        if not self.norms_outputs:  # Llama's norm before the MLP
            hidden_states = self.post_attention_layernorm(hidden_states)
        elif self.norms_inputs:
            hidden_states = self.pre_feedforward_layernorm(hidden_states)
        hidden_states = self.mlp(hidden_states)
        if self.norms_outputs:
            hidden_states = self.post_feedforward_layernorm(hidden_states)
        hidden_states = residual + hidden_states
        if self.hands_on_keys_values:
            return hidden_states, residual_values, shared_keys, shared_values
        return hidden_states, residual_values, None, None


@auto_docstring
class ResFormerPreTrainedModel(CheckpointChecks, ParallelismHooks, VocabularyResizing, PreTrainedModel):
    config: ResFormerConfig
    config_class = ResFormerConfig
    base_model_prefix = "model"
    supports_gradient_checkpointing = True
    _no_split_modules = ["ResFormerDecoderLayer"]
    _skip_keys_device_placement = [CACHE_ARGUMENT]
    _keep_in_fp32_modules_strict = ["value_residual", "depth_weighted_average"]
    _supports_flash_attn = True
    _supports_sdpa = True
    _supports_flex_attn = True
    _can_compile_fullgraph = True
    _supports_attention_backend = True
    _can_record_outputs = {
        "hidden_states": OutputRecorder(ResFormerDecoderLayer, index=0),
        "attentions": OutputRecorder(ResFormerAttention, index=1),
    }

    def __init__(self, config: ResFormerConfig, *inputs, **kwargs):
        # When this file runs as remote code (`trust_remote_code=True`, no `resformer_hf` installed) nothing has
        # registered model type "resformer" (the config class is transformers' own copy of configuration_resformer.py):
        # the generic heads build their body with `AutoModel.from_config(config)`, the Trainer and pipelines look class
        # names up in transformers' name tables, PEFT picks default target modules by model type. Done here, they
        # treat a remote-code ResFormer as `import resformer_hf` makes them treat the plugin's (idempotent, cheap).
        if getattr(config, "model_type", None) == ResFormerConfig.model_type:
            AutoModel.register(type(config), ResFormerModel, exist_ok=True)
            register_model_type_names()
            register_peft_target_modules()
        super().__init__(config, *inputs, **kwargs)
        self._keep_in_fp32_modules_strict = modules_kept_in_float32(config)

    @torch.no_grad()
    def _init_weights(self, module: nn.Module) -> None:
        super()._init_weights(module)
        init_base_block(module)  # Gemma 3's norms, embedding scale and RoPE per layer type
        if isinstance(module, (ValueResidual, DepthWeightedAverage, ValueGate, *VALUE_EMBEDDING_MODULES)):  # at zero
            for parameter in module.parameters(recurse=False):
                init.zeros_(parameter)
        if isinstance(module, (ValueResidual, DepthWeightedAverage)):  # buffers a meta-device build left empty
            for name, fresh in module.exact_buffers().items():
                init.copy_(getattr(module, name), fresh)

    def value_residual_lambdas(self) -> torch.Tensor:
        """Effective (λ_first, λ_self) of every layer, float32 [num_hidden_layers, 2].

        Row 0 and layers that do not receive V_0 are (0, 1); `svformer` rows n >= 1 are (1, 0); `dense` gives the
        weights on V_0 and on the layer's own value; `neutreno` gives (λ, 1 - λ), the mix its correction term
        `λ(V_0 - V_n)` would make of a token's own values. On a model sharded by FSDP2 or DeepSpeed ZeRO-3 the λ
        are gathered first, so every rank must call it. `gated` mixes per token: its rows show the mix of a token
        whose gate input moves nothing, `g0 − 0.5 + σ(b_g)` averaged over kv heads (see `value_gate_statistics` for
        the mix on text).
        """
        table = self.base_model.value_residual.lambda_table()
        for layer in self.config.layers_with_value_gate:
            gate = self.base_model.layers[layer].self_attn.value_gate
            with gathered_parameters(gate):
                first = self.config.value_residual_lambda_first_resolved + gate.resting_shift()
            table[layer] = torch.tensor([first, 1.0 - first])
        return table


@auto_docstring
class ResFormerModel(ResFormerPreTrainedModel):
    def __init__(self, config: ResFormerConfig):
        super().__init__(config)
        self.padding_idx = config.pad_token_id
        self.vocab_size = config.vocab_size

        self.embed_tokens = token_embedding(config)  # Gemma 3: scaled
        self.layers = nn.ModuleList(
            [ResFormerDecoderLayer(config, layer_idx) for layer_idx in range(config.num_hidden_layers)]
        )
        self.norm = rms_norm(config, config.hidden_size)
        self.rotary_emb = rotary_embedding(config)  # one per layer type where `rope_parameters` has one per type
        self.rope_by_layer_type = rope_by_layer_type(config)
        self.attention_kinds = tuple(dict.fromkeys(config.attention_types))  # one mask and one RoPE for each
        self.value_residual = ValueResidual(config)
        self.depth_weighted_average = DepthWeightedAverage.for_config(config)  # DenseFormer only, else None
        self.gradient_checkpointing = False

        self.post_init()

    @accepts_cache
    @merge_with_config_defaults
    @capture_outputs
    @auto_docstring
    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        cache: Cache | None = None,
        inputs_embeds: torch.Tensor | None = None,
        use_cache: bool | None = None,
        **kwargs: Unpack[TransformersKwargs],
    ) -> BaseModelOutputWithPast:
        r"""
        cache (`Cache`, *optional*):
            The KV cache to read and extend (`past_key_values` before transformers 5.24, which is still accepted).
        """
        if (input_ids is None) ^ (inputs_embeds is not None):
            raise ValueError("You must specify exactly one of input_ids or inputs_embeds")
        need_token_ids(self.config, input_ids)  # value embeddings: a ValueError for inputs_embeds alone
        if is_pipeline_stage(self):
            raise ValueError(PIPELINE_PARALLEL_UNSUPPORTED)  # split by transformers' pipeline stages
        refuse_unread_cache(kwargs, f"{type(self).__name__}.forward")

        if inputs_embeds is None:
            inputs_embeds: torch.Tensor = self.embed_tokens(input_ids)

        if use_cache and cache is None:
            cache = new_dynamic_cache(self.config)

        if position_ids is None:
            past_seen_tokens = cache.get_seq_length() if cache is not None else 0
            position_ids = torch.arange(inputs_embeds.shape[1], device=inputs_embeds.device) + past_seen_tokens
            position_ids = position_ids.unsqueeze(0)

        # One mask per layer type (`generate()` may hand them in made), one RoPE per type where each has its own
        masks = attention_mask
        if not isinstance(masks, dict):
            masks = self.causal_masks(inputs_embeds, attention_mask, cache, position_ids)
        hidden_states = inputs_embeds
        if self.rope_by_layer_type:
            rope = {kind: self.rotary_emb(hidden_states, position_ids, kind) for kind in self.attention_kinds}
        else:
            rope = dict.fromkeys(self.attention_kinds, self.rotary_emb(hidden_states, position_ids=position_ids))
        # one λ table for every layer, cast once to the values' dtype
        lambdas = self.value_residual.per_layer(compute_dtype(inputs_embeds), inputs_embeds.shape[1])
        residual_values = shared_keys = shared_values = None
        stream = None
        if self.depth_weighted_average is not None:  # DenseFormer: block 1 reads X_0 from the stream's buffer
            stream = self.depth_weighted_average.begin(hidden_states)
            inputs_embeds = hidden_states = stream.first  # the buffer's row: the embeddings are kept once

        for decoder_layer in self.layers[: self.config.num_hidden_layers]:
            hidden_states, residual_values, shared_keys, shared_values = decoder_layer(
                hidden_states, residual_values, *lambdas[decoder_layer.layer_idx], shared_keys, shared_values,
                attention_mask=masks[decoder_layer.attention_type], position_ids=position_ids,
                position_embeddings=rope[decoder_layer.attention_type],
                cache=cache, use_cache=use_cache, value_embedding_ids=input_ids, **kwargs,  # value embeddings
            )
            if stream is not None:
                hidden_states = stream.after_block(hidden_states)

        hidden_states = self.norm(hidden_states)
        return model_output(BaseModelOutputWithPast, last_hidden_state=hidden_states, cache=cache)

    def causal_masks(self, inputs_embeds, attention_mask, cache, position_ids) -> dict:
        """One mask per layer type (a sliding window's, a full one's), as transformers' models with layer types make
        them. (A function of its own: a dict of these arguments kept in `forward` would keep the embeddings alive.)"""
        arguments = dict(config=self.config, inputs_embeds=inputs_embeds, attention_mask=attention_mask, cache=cache,
                         position_ids=position_ids)
        return {kind: CAUSAL_MASKS[kind](**arguments) for kind in self.attention_kinds}


@auto_docstring
class ResFormerForCausalLM(ResFormerPreTrainedModel, GenerationMixin):
    _tied_weights_keys = {"lm_head.weight": "model.embed_tokens.weight"}
    _tp_plan = {"lm_head": "colwise_gather_output"}
    _pp_plan = {"lm_head": (["hidden_states"], ["logits"])}
    _fsdp_plan = {"lm_head": "keep_full_weight"}

    def __init__(self, config: ResFormerConfig):
        super().__init__(config)
        self.model = ResFormerModel(config)
        self.vocab_size = config.vocab_size
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)

        self.post_init()

    # Llama's head, reused as is; on 5.24 `accepts_cache` keeps a cache its `deprecate_kwarg` would drop (see there).
    forward = accepts_cache(LlamaForCausalLM.forward) if CACHE_ARGUMENT == "cache" else LlamaForCausalLM.forward

    def _prepare_cache_for_generation(self, generation_config, model_kwargs: dict, *args, **kwargs) -> None:
        """`generate()`'s own cache (dynamic, static, ...), with values stored once for SVFormer and K/V once per
        group with cross-layer attention; a cache the user passed in is left as it is. A private `GenerationMixin`
        hook of transformers 5.19-5.24."""
        super()._prepare_cache_for_generation(generation_config, model_kwargs, *args, **kwargs)
        cache = generation_cache(model_kwargs)
        user_defined = getattr(cache, "_is_user_defined", False)
        if cache is not None and not user_defined:
            share_cache_storage(cache, self.config)


class ResFormerForSequenceClassification(GenericForSequenceClassification, ResFormerPreTrainedModel): ...


class ResFormerForQuestionAnswering(GenericForQuestionAnswering, ResFormerPreTrainedModel): ...


class ResFormerForTokenClassification(GenericForTokenClassification, ResFormerPreTrainedModel): ...


#: transformers' model-type → class-name tables that list "llama", with the ResFormer class for each. Code that never
#: sees the Auto registries reads them: `Trainer` shifts labels for label smoothing only for class names in the
#: causal-LM table (unshifted labels train silently wrong), model cards and `transformers serve` pick the task from
#: them. `CONFIG_MAPPING_NAMES` is left alone on purpose: the lazy Auto mappings import `transformers.models.<type>`
#: for every model type listed there.
MODEL_TYPE_NAME_TABLES = {
    "MODEL_MAPPING_NAMES": ResFormerModel,
    "MODEL_FOR_CAUSAL_LM_MAPPING_NAMES": ResFormerForCausalLM,
    "MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES": ResFormerForSequenceClassification,
    "MODEL_FOR_QUESTION_ANSWERING_MAPPING_NAMES": ResFormerForQuestionAnswering,
    "MODEL_FOR_TOKEN_CLASSIFICATION_MAPPING_NAMES": ResFormerForTokenClassification,
}


def register_model_type_names() -> None:
    """List model type "resformer" in each of `MODEL_TYPE_NAME_TABLES`, as "llama" is; safe to call more than once."""
    for table_name, model_class in MODEL_TYPE_NAME_TABLES.items():
        getattr(modeling_auto, table_name).setdefault(ResFormerConfig.model_type, model_class.__name__)


__all__ = ["MODEL_TYPE_NAME_TABLES", "register_model_type_names", "ResFormerPreTrainedModel", "ResFormerModel",
           "ResFormerForCausalLM", "ResFormerForSequenceClassification", "ResFormerForQuestionAnswering",
           "ResFormerForTokenClassification"]
