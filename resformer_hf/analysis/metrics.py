"""Per-layer numbers behind the paper's analyses: attention entropy, token similarity, the λ table, and the mix that a
`gated` model's value gates give its tokens.

Value Residual Learning claims that carrying layer 0's values upward keeps deep layers' attention less concentrated
and their token representations less alike (less over-smoothing). These functions measure exactly that, per layer,
for any ResFormer or Llama model, and return plain tensors.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from transformers import PreTrainedModel


@contextlib.contextmanager
def _eager_attention(model: PreTrainedModel) -> Iterator[None]:
    """Temporarily switch to eager attention: only it materialises the probabilities that entropy needs."""
    previous = model.config._attn_implementation
    if previous != "eager":
        model.set_attn_implementation("eager")
    try:
        yield
    finally:
        if previous != "eager":
            model.set_attn_implementation(previous)


def _valid_mask(input_ids: torch.Tensor, attention_mask: torch.Tensor | None) -> torch.Tensor:
    if attention_mask is None:
        return torch.ones_like(input_ids, dtype=torch.bool)
    if attention_mask.shape != input_ids.shape:
        raise ValueError(
            f"attention_mask has shape {tuple(attention_mask.shape)} but input_ids {tuple(input_ids.shape)}; pass the "
            "2-D padding mask the tokenizer returned."
        )
    return attention_mask.bool()


@torch.no_grad()
def attention_entropy(
    model: PreTrainedModel, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None
) -> torch.Tensor:
    """Mean entropy (nats) of each layer's attention distributions, float32 CPU tensor [num_hidden_layers].

    For every head and every non-padding query token, `H = -Σ_k p_k log p_k` over the keys it attends to; the layer's
    number is the mean over heads and query tokens of the batch. Low entropy = concentrated attention (the paper's
    "attention sink" symptom). Runs the model with eager attention (switched back afterwards).
    """
    valid = _valid_mask(input_ids, attention_mask)
    with _eager_attention(model):
        outputs = model(input_ids=input_ids, attention_mask=attention_mask, output_attentions=True, use_cache=False)
    if not outputs.attentions or any(a is None for a in outputs.attentions):
        raise ValueError(f"{type(model).__name__} returned no attention probabilities; it cannot be analysed here.")
    weight = valid.float()  # [B, T] query tokens that count
    entropies = []
    for probabilities in outputs.attentions:  # [B, H, T, T]
        probabilities = probabilities.float()
        per_query = -torch.special.xlogy(probabilities, probabilities).sum(-1).mean(1)  # [B, T], mean over heads
        entropies.append((per_query * weight).sum() / weight.sum())
    return torch.stack(entropies).cpu()


def _mean_pairwise_cosine(states: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """Mean cosine similarity over ordered pairs i != j of valid tokens, averaged over sequences ([B, T, D] input)."""
    units = torch.nn.functional.normalize(states.float(), dim=-1) * valid[..., None]
    count = valid.sum(-1).float()  # tokens per sequence
    total = units.sum(1)  # Σ_i u_i
    # Σ_{i != j} u_i·u_j = |Σ_i u_i|² − Σ_i |u_i|² = |Σ_i u_i|² − n (unit vectors).
    pair_sum = (total * total).sum(-1) - count
    usable = count >= 2
    if not usable.any():
        raise ValueError("token similarity needs at least 2 non-padding tokens in some sequence; pass longer text.")
    return (pair_sum[usable] / (count[usable] * (count[usable] - 1))).mean()


@torch.no_grad()
def token_similarity(
    model: PreTrainedModel, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None
) -> torch.Tensor:
    """Mean pairwise cosine similarity of token representations, float32 CPU tensor [num_hidden_layers + 1].

    Entry 0 is the embeddings, entry n the output of layer n (the last one after the final norm, as transformers
    returns it). Values near 1 mean the tokens have collapsed onto one direction (over-smoothing).
    """
    valid = _valid_mask(input_ids, attention_mask)
    outputs = model(input_ids=input_ids, attention_mask=attention_mask, output_hidden_states=True, use_cache=False)
    return torch.stack([_mean_pairwise_cosine(h, valid) for h in outputs.hidden_states]).cpu()


def lambda_table(model: PreTrainedModel) -> torch.Tensor:
    """Effective (λ_first, λ_self) per layer, float32 [num_hidden_layers, 2] (`value_residual_lambdas()`); a plain
    Llama is (0, 1) everywhere."""
    base = getattr(model, "base_model", model)
    if hasattr(base, "value_residual_lambdas"):
        return base.value_residual_lambdas()
    table = torch.zeros(model.config.num_hidden_layers, 2)
    table[:, 1] = 1.0
    return table


__all__ = ["attention_entropy", "lambda_table", "token_similarity"]


@torch.no_grad()
def value_gate_statistics(
    model: PreTrainedModel, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None
) -> dict[int, dict[str, float]]:
    """The mix on V_0 that each gated layer (`value_residual="gated"`) gives the batch's tokens: `{layer: {"mean",
    "std", "min", "max"}}` over every non-padding token and kv head (`std` over them too: how much the mix depends on
    the token). Empty for a model without value gates (every other variant, a Llama).

    The mix is what the layer's gate computes from its normalised input, read by a hook on each gated attention
    layer during one forward pass without cache.
    """
    valid = _valid_mask(input_ids, attention_mask)
    gated = [module for module in model.modules() if hasattr(module, "value_gate")]
    mixes: dict[int, torch.Tensor] = {}

    def record(module, args, kwargs):
        hidden_states = args[0] if args else kwargs["hidden_states"]
        mixes[module.layer_idx] = module.value_gate.mix(hidden_states, module.gate_shift)  # [B, T, H_kv]

    hooks = [module.register_forward_pre_hook(record, with_kwargs=True) for module in gated]
    try:
        if hooks:
            model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False)
    finally:
        for hook in hooks:
            hook.remove()
    statistics = {}
    for layer, mix in sorted(mixes.items()):
        values = mix[valid.to(mix.device)]  # [tokens, H_kv]
        statistics[layer] = {"mean": values.mean().item(), "std": values.std(correction=0).item(),
                             "min": values.min().item(), "max": values.max().item()}
    return statistics
