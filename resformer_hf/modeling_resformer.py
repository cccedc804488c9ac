"""ResFormer models: Llama's decoder with the value residual wired into attention.

Built from Llama's own blocks (MLP, RMSNorm, rotary embedding, attention interface, masks, heads); only the
attention and the decoder loop change, to carry layer 0's values to later layers. The value-residual math is in
`value_residual.py`. This file is copied next to `config.json` for `trust_remote_code` loading, so it imports only
torch, transformers and its sibling files.
"""

from __future__ import annotations

import re
from collections.abc import Callable

import torch
from torch import nn
from transformers import AutoModel
from transformers import initialization as init
from transformers.cache_utils import Cache
from transformers.generation import GenerationMixin
from transformers.masking_utils import create_causal_mask
from transformers.modeling_layers import (
    GenericForQuestionAnswering,
    GenericForSequenceClassification,
    GenericForTokenClassification,
    GradientCheckpointingLayer,
)
from transformers.modeling_outputs import BaseModelOutputWithPast
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS, PreTrainedModel
from transformers.models.llama.modeling_llama import (
    LlamaAttention,
    LlamaForCausalLM,
    LlamaMLP,
    LlamaRMSNorm,
    LlamaRotaryEmbedding,
    apply_rotary_pos_emb,
    eager_attention_forward,
)
from transformers.processing_utils import Unpack
from transformers.utils import TransformersKwargs, auto_docstring
from transformers.utils.generic import merge_with_config_defaults
from transformers.utils.output_capturing import OutputRecorder, capture_outputs

from .cache_resformer import new_dynamic_cache, share_first_layer_values
from .configuration_resformer import CORRECT, MIX, MIX_ALL, REUSE, VARIANTS, ResFormerConfig
from .value_residual import ValueResidual, mix_values, neutreno_correction


class ResFormerAttention(LlamaAttention):
    """Llama attention whose values are mixed with layer 0's before the cache update and before attention.

    SVFormer layers n >= 1 have no `v_proj`: they attend over layer 0's values. NeuTRENO layers attend over their own
    values and add `λ(V_0 - V_n)` afterwards.
    """

    def __init__(self, config: ResFormerConfig, layer_idx: int):
        super().__init__(config, layer_idx)
        role = config.value_residual_layer_roles[layer_idx]
        self.reuses_first_values = role == REUSE
        self.applies_neutreno = role == CORRECT
        self.mixes_values = role in (MIX, MIX_ALL)
        if self.reuses_first_values:
            self.v_proj = None

    def forward(
        self,
        hidden_states: torch.Tensor,
        residual_values: torch.Tensor | None,
        value_weights: torch.Tensor,
        position_embeddings: tuple[torch.Tensor, torch.Tensor] | None = None,
        attention_mask: torch.Tensor | None = None,
        past_key_values: Cache | None = None,
        **kwargs: Unpack[TransformersKwargs],
    ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
        """Returns (attention output, attention weights, this layer's raw values V_n on the kv heads)."""
        input_shape = hidden_states.shape[:-1]
        hidden_shape = (*input_shape, -1, self.head_dim)

        query_states = self.q_proj(hidden_states).view(hidden_shape).transpose(1, 2)
        key_states = self.k_proj(hidden_states).view(hidden_shape).transpose(1, 2)
        if self.reuses_first_values:
            own_values = residual_values[0]
        else:
            own_values = self.v_proj(hidden_states).view(hidden_shape).transpose(1, 2)
        value_states = own_values
        if self.mixes_values:
            value_states = mix_values(own_values, residual_values, value_weights, self.layer_idx)

        cos, sin = position_embeddings
        query_states, key_states = apply_rotary_pos_emb(query_states, key_states, cos, sin)

        if past_key_values is not None:
            key_states, value_states = past_key_values.update(key_states, value_states, self.layer_idx)

        attention_interface: Callable = ALL_ATTENTION_FUNCTIONS.get_interface(
            self.config._attn_implementation, eager_attention_forward
        )
        attn_output, attn_weights = attention_interface(
            self,
            query_states,
            key_states,
            value_states,
            attention_mask,
            dropout=0.0 if not self.training else self.attention_dropout,
            scaling=self.scaling,
            **kwargs,
        )
        if self.applies_neutreno:
            attn_output = attn_output + neutreno_correction(
                residual_values[0], own_values, value_weights, self.num_key_value_groups
            )

        attn_output = attn_output.reshape(*input_shape, -1).contiguous()
        attn_output = self.o_proj(attn_output)
        return attn_output, attn_weights, own_values


class ResFormerDecoderLayer(GradientCheckpointingLayer):
    """Llama's pre-norm decoder layer that also passes the residual values on to the next layer.

    `residual_values` and `value_weights` are positional so that reentrant gradient checkpointing propagates their
    gradients; the updated `residual_values` are returned next to the hidden states.
    """

    def __init__(self, config: ResFormerConfig, layer_idx: int):
        super().__init__()
        self.hidden_size = config.hidden_size
        self.layer_idx = layer_idx
        self.self_attn = ResFormerAttention(config=config, layer_idx=layer_idx)
        self.mlp = LlamaMLP(config)
        self.input_layernorm = LlamaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = LlamaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        # Layer 0 starts the stack of raw values later layers read; with a dense mix every later layer appends its own.
        sources = config.value_residual_sources
        self.starts_residual_values = layer_idx == 0 and layer_idx in sources
        self.extends_residual_values = layer_idx > 0 and layer_idx in sources

    def forward(
        self,
        hidden_states: torch.Tensor,
        residual_values: torch.Tensor | None,
        value_weights: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        past_key_values: Cache | None = None,
        use_cache: bool | None = False,
        position_embeddings: tuple[torch.Tensor, torch.Tensor] | None = None,
        **kwargs: Unpack[TransformersKwargs],
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        residual = hidden_states
        hidden_states = self.input_layernorm(hidden_states)
        hidden_states, _, own_values = self.self_attn(
            hidden_states,
            residual_values,
            value_weights,
            attention_mask=attention_mask,
            position_ids=position_ids,
            past_key_values=past_key_values,
            use_cache=use_cache,
            position_embeddings=position_embeddings,
            **kwargs,
        )
        hidden_states = residual + hidden_states

        residual = hidden_states
        hidden_states = self.post_attention_layernorm(hidden_states)
        hidden_states = self.mlp(hidden_states)
        hidden_states = residual + hidden_states

        if self.starts_residual_values:
            residual_values = own_values.unsqueeze(0)
        elif self.extends_residual_values:
            residual_values = torch.cat((residual_values, own_values.unsqueeze(0)), dim=0)
        return hidden_states, residual_values


@auto_docstring
class ResFormerPreTrainedModel(PreTrainedModel):
    config: ResFormerConfig
    config_class = ResFormerConfig
    base_model_prefix = "model"
    supports_gradient_checkpointing = True
    _no_split_modules = ["ResFormerDecoderLayer"]
    _skip_keys_device_placement = ["past_key_values"]
    _keep_in_fp32_modules_strict = ["value_residual"]
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
        # The generic heads build their body with `AutoModel.from_config(config)`. When this file runs as remote code
        # (`trust_remote_code=True`, no `resformer_hf` installed) nothing has registered this config's class, which
        # transformers loads from its own copy of configuration_resformer.py; registering it here makes them work.
        if getattr(config, "model_type", None) == ResFormerConfig.model_type:
            AutoModel.register(type(config), ResFormerModel, exist_ok=True)
        super().__init__(config, *inputs, **kwargs)
        if not config.value_residual_spec.learnable:  # no λ parameters, so nothing to keep in float32 on load
            self._keep_in_fp32_modules_strict = []

    @torch.no_grad()
    def _init_weights(self, module: nn.Module) -> None:
        super()._init_weights(module)
        if isinstance(module, ValueResidual):
            for parameter in module.parameters(recurse=False):
                init.zeros_(parameter)
            if module.fixed_weights is not None:
                init.copy_(module.fixed_weights, module.mixing_weights(module.fixed_weights.device))

    def value_residual_lambdas(self) -> torch.Tensor:
        """Effective (λ_first, λ_self) of every layer, float32 [num_hidden_layers, 2].

        Row 0 and layers that do not receive V_0 are (0, 1); `svformer` rows n >= 1 are (1, 0); `dense` gives the
        weights on V_0 and on the layer's own value; `neutreno` gives (λ, 1 - λ), the mix its correction term
        `λ(V_0 - V_n)` would make of a token's own values.
        """
        return self.base_model.value_residual.lambda_table()

    def _adjust_missing_and_unexpected_keys(self, loading_info) -> None:
        """Refuse a checkpoint of the other value-projection layout instead of dropping or random-initialising v_proj.

        SVFormer layers n >= 1 have no `v_proj`; every other variant has one. A mismatch means the checkpoint was
        trained as a different variant than the config says.
        """
        super()._adjust_missing_and_unexpected_keys(loading_info)
        config = self.config
        without = set(config.layers_without_value_projection)
        extra = [layer for layer in _layers_with(loading_info.unexpected_keys, "v_proj") if layer in without]
        if extra:
            raise ValueError(
                f"Variant mismatch: the model is value_residual={config.value_residual!r}, which has no v_proj in "
                f"layers {sorted(without)}, but the checkpoint has v_proj weights for layers {extra}, so it was "
                "trained as another variant. Load it with the value_residual its config.json names."
            )
        # Missing v_proj means "trained without them" only where the same layer's other projections did load: a
        # checkpoint that lacks everything (wrong prefix, another model) gets transformers' missing-keys report.
        loaded_layers = set(range(config.num_hidden_layers)) - set(_layers_with(loading_info.missing_keys, "q_proj"))
        absent = [
            layer for layer in _layers_with(loading_info.missing_keys, "v_proj")
            if layer not in without and layer in loaded_layers
        ]
        if absent:
            reusing = [name for name, spec in VARIANTS.items() if spec.drops_value_projections]
            raise ValueError(
                f"Variant mismatch: the model is value_residual={config.value_residual!r}, but the checkpoint has no "
                f"v_proj weights for layers {absent} while their other projections are there, so it was trained "
                f"without them ({' or '.join(reusing)}). Load it with the value_residual its config.json names "
                "instead of random-initialising those projections."
            )
        self._check_lambdas_are_finite()

    def _check_lambdas_are_finite(self) -> None:
        """Refuse NaN/inf λ from a checkpoint, as the config refuses them: they would silently give NaN logits."""
        for name, parameter in self.base_model.value_residual.named_parameters():
            if parameter.device.type != "meta" and not torch.isfinite(parameter.detach()).all():
                raise ValueError(
                    f"The checkpoint's model.value_residual.{name} holds NaN or infinite values, so the model would "
                    "output NaN. Load a healthy save of the checkpoint instead."
                )


@auto_docstring
class ResFormerModel(ResFormerPreTrainedModel):
    def __init__(self, config: ResFormerConfig):
        super().__init__(config)
        self.padding_idx = config.pad_token_id
        self.vocab_size = config.vocab_size

        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size, self.padding_idx)
        self.layers = nn.ModuleList(
            [ResFormerDecoderLayer(config, layer_idx) for layer_idx in range(config.num_hidden_layers)]
        )
        self.norm = LlamaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.rotary_emb = LlamaRotaryEmbedding(config=config)
        self.value_residual = ValueResidual(config)
        self.gradient_checkpointing = False

        self.post_init()

    @merge_with_config_defaults
    @capture_outputs
    @auto_docstring
    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        past_key_values: Cache | None = None,
        inputs_embeds: torch.Tensor | None = None,
        use_cache: bool | None = None,
        **kwargs: Unpack[TransformersKwargs],
    ) -> BaseModelOutputWithPast:
        if (input_ids is None) ^ (inputs_embeds is not None):
            raise ValueError("You must specify exactly one of input_ids or inputs_embeds")

        if inputs_embeds is None:
            inputs_embeds: torch.Tensor = self.embed_tokens(input_ids)

        if use_cache and past_key_values is None:
            past_key_values = new_dynamic_cache(self.config)

        if position_ids is None:
            past_seen_tokens = past_key_values.get_seq_length() if past_key_values is not None else 0
            position_ids = torch.arange(inputs_embeds.shape[1], device=inputs_embeds.device) + past_seen_tokens
            position_ids = position_ids.unsqueeze(0)

        causal_mask = create_causal_mask(
            config=self.config,
            inputs_embeds=inputs_embeds,
            attention_mask=attention_mask,
            past_key_values=past_key_values,
            position_ids=position_ids,
        )

        hidden_states = inputs_embeds
        position_embeddings = self.rotary_emb(hidden_states, position_ids=position_ids)
        value_weights = self.value_residual()
        residual_values = None

        for decoder_layer in self.layers[: self.config.num_hidden_layers]:
            hidden_states, residual_values = decoder_layer(
                hidden_states,
                residual_values,
                value_weights[decoder_layer.layer_idx],
                attention_mask=causal_mask,
                position_embeddings=position_embeddings,
                position_ids=position_ids,
                past_key_values=past_key_values,
                use_cache=use_cache,
                **kwargs,
            )

        hidden_states = self.norm(hidden_states)
        return BaseModelOutputWithPast(
            last_hidden_state=hidden_states,
            past_key_values=past_key_values,
        )


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

    # Llama's causal-LM head is reused as is: the base model is the only difference.
    forward = LlamaForCausalLM.forward

    def _prepare_cache_for_generation(self, generation_config, model_kwargs: dict, *args, **kwargs) -> None:
        """`generate()`'s own cache (dynamic, static, ...), with values stored once for SVFormer; a cache the user
        passed in is left as it is."""
        super()._prepare_cache_for_generation(generation_config, model_kwargs, *args, **kwargs)
        cache = model_kwargs.get("past_key_values")
        user_defined = getattr(cache, "_is_user_defined", False)
        if self.config.layers_without_value_projection and cache is not None and not user_defined:
            share_first_layer_values(cache)


_PROJECTION_KEY = re.compile(r"(?:^|\.)layers\.(\d+)\.self_attn\.(\w+)\.")


def _layers_with(keys, projection: str) -> list[int]:
    """Sorted layer indices that have a `self_attn.<projection>` entry among `keys`."""
    matches = (_PROJECTION_KEY.search(key) for key in keys)
    return sorted({int(match.group(1)) for match in matches if match and match.group(2) == projection})


class ResFormerForSequenceClassification(GenericForSequenceClassification, ResFormerPreTrainedModel): ...


class ResFormerForQuestionAnswering(GenericForQuestionAnswering, ResFormerPreTrainedModel): ...


class ResFormerForTokenClassification(GenericForTokenClassification, ResFormerPreTrainedModel): ...


__all__ = [
    "ResFormerPreTrainedModel",
    "ResFormerModel",
    "ResFormerForCausalLM",
    "ResFormerForSequenceClassification",
    "ResFormerForQuestionAnswering",
    "ResFormerForTokenClassification",
]
