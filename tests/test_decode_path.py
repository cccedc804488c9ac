"""The pass without gradient, held to the independent reference (`tests/reference.py`): learnable λ (and
DenseFormer's α) as tensors, the one decode path every device takes (a GPU, a sharded or compiled model, the CPU).

For every variant and the CLA2 options, with λ moved off their initial values, at lengths on both sides of
`BATCHED_SCALING_MAX_TOKENS` (layer 0 scales V_0 for every receiver at once, or each receiver scales it when it
runs): a no-grad forward, and greedy decoding with a dynamic and a static cache after a short and a long prefill; and
in bfloat16 with λ kept float32, as a GPU user loads a model.
"""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache, StaticCache

from resformer_hf import ResFormerConfig, ResFormerForCausalLM
from resformer_hf.remote_code.cache_resformer import share_cache_storage
from resformer_hf.remote_code.lambdas import BATCHED_SCALING_MAX_TOKENS
from resformer_hf.remote_code.variants import PAIR, SOFTMAX, VARIANTS

from helpers import NON_DEFAULT, TINY, decode_logits, model_with_random_lambdas
from reference import reference_logits

#: Every variant with non-default λ, the cross-layer-attention options, and receivers that leave a plain layer between
#: (learnable) or after (dense) them, which the tensor path hands the residual values through.
CASES = {
    **{variant: dict(value_residual=variant, **fields) for variant, fields in NON_DEFAULT.items()},
    "cla2": dict(value_residual="none", cross_layer_attention=2),
    "svformer_cla2": dict(value_residual="svformer", cross_layer_attention=2),
    "denseformer_cla2": dict(value_residual="denseformer", cross_layer_attention=2, denseformer_dilation=2),
    "learnable_layers_1_3": dict(value_residual="learnable", value_residual_layers=[1, 3]),
    "dense_layers_1_2": dict(value_residual="dense", value_residual_layers=[1, 2]),
}
#: Largest |logits − reference| allowed, relative to the reference's largest |logit| (float32 rounding). Measured over
#: these cases, forward and decode steps: at most 2.9e-6, on the tensor path as on the numbers path. A long prefill
#: that scales V_0 with the previous receiver's λ_first moves them by 0.04 to 0.5; λ_self applied to V_0 instead of
#: V_n (own and first swapped in the mix) fails at both lengths.
RELATIVE_TOLERANCE = 1e-5
#: A short prompt, and one whose prefill scales V_0 for each receiver when it runs.
LENGTHS = [8, BATCHED_SCALING_MAX_TOKENS + 24]
STEPS = 5


def case_model(case: str):
    """A tiny model of `case` with random λ (and depth-weight) offsets; a larger init, so greedy picks no near-ties."""
    torch.manual_seed(0)
    return model_with_random_lambdas(ResFormerConfig(**{**TINY, "initializer_range": 0.2, **CASES[case]}))


def relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return ((actual - expected).abs().max() / expected.abs().max()).item()


def new_cache(model, kind: str, length: int):
    """The cache `generate()` would make: values once for SVFormer, K/V once per layer group with CLA."""
    cache = (DynamicCache(config=model.config) if kind == "dynamic"
             else StaticCache(config=model.config, max_cache_len=length))
    return share_cache_storage(cache, model.config)


@pytest.mark.parametrize("length", LENGTHS)
def test_layer_zero_scales_the_first_values_for_every_receiver_only_when_decoding_a_learnable_mix(variant, length):
    """The paths the tests below hold are the ones taken: without gradient, over a few tokens, layer 0 of a learnable
    mix hands on λ_first·V_0 of every receiver (a tuple); over a long prompt, with gradient, and for every other
    variant it hands on V_0 itself (`dense`: its buffer's first row)."""
    model = case_model(variant)
    handed_on = []
    model.model.layers[0].self_attn.register_forward_hook(lambda module, args, output: handed_on.append(output[2]))
    input_ids = torch.randint(3, 128, (2, length))
    with torch.no_grad():
        model(input_ids)
    model(input_ids)
    kinds = ["none" if values is None else "tuple" if isinstance(values, tuple) else values.dim()
             for values in handed_on]
    learnable_mix = VARIANTS[variant].lambdas in (PAIR, SOFTMAX)
    expected = ["tuple" if learnable_mix and length <= BATCHED_SCALING_MAX_TOKENS else 4, 4]
    if not model.config.value_residual_receivers or VARIANTS[variant].depth_weighted_average:
        expected = ["none", "none"]  # nothing is handed on
    elif model.config.value_residual_spec.keeps_every_layers_values:
        expected = [5, 5]
    assert kinds == expected


@pytest.mark.parametrize("length", LENGTHS)
@pytest.mark.parametrize("case", CASES)
def test_a_forward_without_gradient_matches_the_reference(case, length):
    model = case_model(case)
    input_ids = torch.randint(3, 128, (2, length))
    state = {k: v.detach() for k, v in model.state_dict().items()}
    with torch.no_grad():
        actual = model(input_ids).logits
    assert relative_error(actual, reference_logits(model.config, state, input_ids)) <= RELATIVE_TOLERANCE


@pytest.mark.parametrize("prompt_length", LENGTHS)
@pytest.mark.parametrize("cache_kind", ["dynamic", "static"])
@pytest.mark.parametrize("case", CASES)
def test_cached_greedy_decoding_matches_the_reference(case, cache_kind, prompt_length):
    """Prefill (short, or long enough to scale V_0 per receiver) then one-token steps (V_0 scaled for all receivers at
    once): every step's logits are the reference's at that position, its tokens the reference's greedy choices and
    those of the uncached reference."""
    model = case_model(case)
    prompt = torch.randint(3, 128, (2, prompt_length))
    with torch.no_grad():
        cache = new_cache(model, cache_kind, prompt_length + STEPS)
        step_logits, tokens = decode_logits(model, model, prompt, STEPS, cache)
    state = {k: v.detach() for k, v in model.state_dict().items()}
    expected = reference_logits(model.config, state, tokens)
    for step, logits in enumerate(step_logits):
        assert relative_error(logits, expected[:, prompt_length + step - 1]) <= RELATIVE_TOLERANCE, step
    assert torch.equal(tokens[:, prompt_length:], expected[:, prompt_length - 1 : -1].argmax(-1))


#: Largest |bf16 logits − float32 reference| allowed, relative to the reference's largest |logit|: measured at most
#: 1.2e-2 (3 seeds × these cases, prefill and decode steps).
BF16_RELATIVE_TOLERANCE = 3e-2
#: The cases whose pass without gradient scales float32 λ (or α) tensors against bf16 values.
TENSOR_CASES = [case for case, fields in CASES.items()
                if (spec := VARIANTS[fields["value_residual"]]).learnable or spec.depth_weighted_average]


@pytest.mark.parametrize("case", TENSOR_CASES)
def test_bfloat16_decoding_stays_in_bfloat16_near_the_reference(case, tmp_path):
    """λ are float32 tensors next to bf16 values: the values they scale, the cache and the logits stay bf16 (a mix in
    float32 would reach attention as float32 values, which it refuses), within bf16's error of the reference."""
    torch.manual_seed(0)
    model = model_with_random_lambdas(ResFormerConfig(**{**TINY, **CASES[case]}))
    model.save_pretrained(tmp_path)
    low = ResFormerForCausalLM.from_pretrained(tmp_path, dtype=torch.bfloat16).eval()
    prompt = torch.randint(3, 128, (2, BATCHED_SCALING_MAX_TOKENS + 24))
    cache = new_cache(low, "dynamic", 0)
    with torch.no_grad():
        step_logits, tokens = decode_logits(low, low, prompt, 3, cache)
    assert {layer.values.dtype for layer in cache.layers} == {torch.bfloat16}
    state = {k: v.detach() for k, v in model.state_dict().items()}
    expected = reference_logits(model.config, state, tokens)
    for step, logits in enumerate(step_logits):
        assert logits.dtype == torch.bfloat16
        error = relative_error(logits.float(), expected[:, prompt.shape[1] + step - 1])
        assert error <= BF16_RELATIVE_TOLERANCE, (step, error)
