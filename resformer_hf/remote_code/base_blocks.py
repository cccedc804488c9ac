"""transformers' own building blocks for the facts of `architecture.py`: each base's RMSNorm, Gemma 3's scaled
embeddings, a rotary embedding per layer type or in float32, reused as they are so that a converted model computes
what its source computed, op for op, in every dtype. The rotation is Llama's `apply_rotary_pos_emb`, or OLMo 2's where
RoPE runs in float32 (the same rotation, its result cast back to the queries' dtype).
Copied next to `config.json` for `trust_remote_code`: imports only torch, transformers and sibling files.
"""

from __future__ import annotations

from torch import nn
from transformers import initialization as init
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
from transformers.models.gemma3.modeling_gemma3 import (
    Gemma3RMSNorm,
    Gemma3RotaryEmbedding,
    Gemma3TextScaledWordEmbedding,
)
from transformers.models.llama import modeling_llama
from transformers.models.llama.modeling_llama import LlamaRMSNorm, LlamaRotaryEmbedding
from transformers.models.olmo2 import modeling_olmo2
from transformers.models.olmo2.modeling_olmo2 import Olmo2RMSNorm, Olmo2RotaryEmbedding
from transformers.models.olmo3.modeling_olmo3 import Olmo3RotaryEmbedding

from .architecture import HEAD, SLIDING, rope_by_layer_type

#: `rms_norm_type` -> transformers' RMSNorm of that model: `w·x̂` cast back first (Llama), `w·x̂` in float32 (OLMo 2),
#: `(1 + w)·x̂` in float32 with w starting at zero (Gemma 3).
RMS_NORMS = {"llama": LlamaRMSNorm, "olmo2": Olmo2RMSNorm, "gemma3": Gemma3RMSNorm}


def rms_norm(config, dim: int) -> nn.Module:
    """The base's RMSNorm over `dim` features."""
    return RMS_NORMS[config.rms_norm_type](dim, eps=config.rms_norm_eps)


def token_embedding(config) -> nn.Embedding:
    """`embed_tokens`: Llama's table, or Gemma 3's, whose output is scaled by `embedding_multiplier` in the weights'
    dtype (inside the module, so engines that embed the tokens themselves, as vLLM does, scale them too)."""
    if config.embedding_multiplier is None:
        return nn.Embedding(config.vocab_size, config.hidden_size, config.pad_token_id)
    return Gemma3TextScaledWordEmbedding(config.vocab_size, config.hidden_size, config.pad_token_id,
                                         embed_scale=float(config.embedding_multiplier))


def rotary_embedding(config) -> nn.Module:
    """Llama's rotary embedding, or with a `rope_parameters` keyed by layer type, Gemma 3's, which gives each layer
    type its own (`forward(x, position_ids, layer_type)`); OLMo 2's and 3's where the rotation runs in float32
    (`rope_in_float32`: they hand out float32 cos and sin, `apply_rotary_pos_emb` casts the result back)."""
    if rope_by_layer_type(config):
        return (Olmo3RotaryEmbedding if config.rope_in_float32 else Gemma3RotaryEmbedding)(config)
    return (Olmo2RotaryEmbedding if config.rope_in_float32 else LlamaRotaryEmbedding)(config)


def init_base_block(module: nn.Module) -> None:
    """What transformers' generic `_init_weights` does not know of these blocks (a model built on the meta device
    holds garbage there until this runs): Gemma 3's norms start at zero (`1 + w` = 1), its embedding scale and its
    per-layer-type RoPE buffers are computed, as `Gemma3PreTrainedModel._init_weights` does."""
    if isinstance(module, Gemma3RMSNorm):
        init.zeros_(module.weight)
    elif isinstance(module, Gemma3TextScaledWordEmbedding):
        init.constant_(module.embed_scale, module.scalar_embed_scale)
    elif isinstance(module, (Gemma3RotaryEmbedding, Olmo3RotaryEmbedding)):
        for layer_type in module.layer_types:
            compute = module.compute_default_rope_parameters
            if module.rope_type[layer_type] != "default":
                compute = ROPE_INIT_FUNCTIONS[module.rope_type[layer_type]]
            inv_freq, _ = compute(module.config, layer_type=layer_type)
            init.copy_(getattr(module, f"{layer_type}_inv_freq"), inv_freq)
            init.copy_(getattr(module, f"{layer_type}_original_inv_freq"), inv_freq)


def attach_base_attention(attention: nn.Module, config, layer_idx: int) -> None:
    """An attention layer's facts of its base (`architecture.py`), read once as its value role is: q/k norms over each
    head or the whole projection, RoPE or none (SmolLM3's NoPE layers), a sliding window, Gemma 3's score scale."""
    attention.qk_norm, attention.q_norm, attention.k_norm = config.qk_norm, None, None
    if attention.qk_norm is not None:
        per_head = attention.qk_norm == HEAD
        attention.q_norm = rms_norm(config, attention.head_dim * (1 if per_head else config.num_attention_heads))
        if attention.k_proj is not None:  # a cross-layer-attention consumer's keys are its producer's, normed there
            attention.k_norm = rms_norm(config, attention.head_dim * (1 if per_head else config.num_key_value_heads))
    # OLMo's rotation casts its float32 result back to the queries' dtype: two calls a layer that other bases skip
    rotate = (modeling_olmo2 if config.rope_in_float32 else modeling_llama).apply_rotary_pos_emb
    attention.rotate = rotate if layer_idx not in (config.nope_layers or ()) else None
    attention.sliding_window = config.sliding_window if config.attention_types[layer_idx] == SLIDING else None
    if config.query_pre_attn_scalar is not None:
        attention.scaling = float(config.query_pre_attn_scalar) ** -0.5


__all__ = ["RMS_NORMS", "attach_base_attention", "init_base_block", "rms_norm", "rotary_embedding",
           "token_embedding"]
