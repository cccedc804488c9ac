"""generate() works for every variant exactly as for Llama: its tokens are the independent reference's
(`tests/reference.py`) choices, cached == uncached, padding-invariant, all strategies."""

from __future__ import annotations

import pytest
import torch
from transformers import CompileConfig

from resformer_hf import ResFormerForCausalLM

from helpers import model_with_random_lambdas, tiny_config
from reference import reference_logits

GREEDY = dict(max_new_tokens=32, do_sample=False, pad_token_id=0, eos_token_id=None)


def model_for(variant: str) -> ResFormerForCausalLM:
    """Tiny model with a larger init so greedy choices are not near-ties, and random λ offsets."""
    torch.manual_seed(0)
    return model_with_random_lambdas(tiny_config(variant, initializer_range=0.2), bound=0.3)


def reference_log_probs(model, sequences: torch.Tensor) -> torch.Tensor:
    """Log-probabilities [B, T-1, V] the independent reference gives each next token of `sequences`."""
    state = {name: tensor.detach() for name, tensor in model.state_dict().items()}
    return torch.log_softmax(reference_logits(model.config, state, sequences)[:, :-1].double(), dim=-1)


def assert_reference_greedy(model, sequences: torch.Tensor, prompt_length: int) -> None:
    """Each generated token is the reference's argmax given the tokens before it (up to float ties of 1e-4)."""
    log_probs = reference_log_probs(model, sequences)[:, prompt_length - 1:]
    chosen = log_probs.gather(-1, sequences[:, prompt_length:, None])[..., 0]
    assert (log_probs.max(-1).values - chosen).max().item() <= 1e-4


def test_greedy_with_cache_equals_without_and_the_reference(variant):
    model = model_for(variant)
    prompt = torch.randint(3, 128, (2, 6))
    cached = model.generate(prompt, use_cache=True, **GREEDY)
    uncached = model.generate(prompt, use_cache=False, **GREEDY)
    assert cached.shape == (2, 6 + 32)
    assert torch.equal(cached, uncached)
    assert_reference_greedy(model, cached, prompt_length=6)


def test_left_padded_batch_equals_each_sample_alone(variant):
    model = model_for(variant)
    short, long = torch.randint(3, 128, (1, 4)), torch.randint(3, 128, (1, 7))
    batch = torch.zeros(2, 7, dtype=torch.long)
    batch[0, 3:], batch[1] = short[0], long[0]
    mask = (torch.arange(7) >= torch.tensor([[3], [0]])).long()
    together = model.generate(batch, attention_mask=mask, **GREEDY)
    alone_short = model.generate(short, **GREEDY)
    alone_long = model.generate(long, **GREEDY)
    assert torch.equal(together[0, 3:], alone_short[0])
    assert torch.equal(together[1], alone_long[0])


def test_beam_search_and_sampling_follow_the_reference(variant):
    """Beam search returns beams whose score (summed log-probabilities: no length penalty) is the reference's for
    those very tokens, best first; sampling's raw logits at every step are the reference's for the drawn prefix, and
    each drawn token is in the reference's top k."""
    model = model_for(variant)
    prompt = torch.randint(3, 128, (2, 5))
    beams = model.generate(prompt, num_beams=3, num_return_sequences=2, max_new_tokens=8, pad_token_id=0,
                           eos_token_id=None, length_penalty=0.0, return_dict_in_generate=True, output_scores=True)
    assert beams.sequences.shape == (4, 13)
    log_probs = reference_log_probs(model, beams.sequences)[:, 4:]
    scores = log_probs.gather(-1, beams.sequences[:, 5:, None])[..., 0].sum(-1)
    assert torch.allclose(beams.sequences_scores.double(), scores, atol=1e-4), (beams.sequences_scores, scores)
    assert (scores.view(2, 2)[:, 0] >= scores.view(2, 2)[:, 1] - 1e-4).all()
    torch.manual_seed(3)
    sampled = model.generate(prompt, do_sample=True, top_k=20, temperature=0.9, max_new_tokens=8, pad_token_id=0,
                             eos_token_id=None, return_dict_in_generate=True, output_logits=True)
    assert sampled.sequences.shape == (2, 13)
    state = {name: tensor.detach() for name, tensor in model.state_dict().items()}
    expected = reference_logits(model.config, state, sampled.sequences)[:, 4:-1]
    assert (torch.stack(sampled.logits, dim=1) - expected).abs().max().item() <= 1e-5
    top_k = expected.topk(20, dim=-1).indices
    assert (top_k == sampled.sequences[:, 5:, None]).any(-1).all()


def test_static_cache_generates_what_the_dynamic_cache_does(variant):
    model = model_for(variant)
    prompt = torch.randint(3, 128, (2, 6))
    static = model.generate(prompt, cache_implementation="static", **GREEDY)
    dynamic = model.generate(prompt, **GREEDY)
    assert torch.equal(static, dynamic)


#: generate() cache paths, each compared with the same decoding strategy run without a cache.
CACHE_PATHS = {
    "beam search": dict(num_beams=3, num_return_sequences=2, max_new_tokens=10),
    "assisted (prompt lookup)": dict(prompt_lookup_num_tokens=3, max_new_tokens=16),
    "static cache": dict(cache_implementation="static", max_new_tokens=16),
}


@pytest.mark.parametrize("path", list(CACHE_PATHS))
def test_every_cache_path_generates_the_uncached_tokens(variant, path):
    model = model_for(variant)
    prompt = torch.tensor([[5, 9, 17, 5, 9, 17, 5, 9]])  # repeats, so prompt lookup has candidates to verify
    settings = dict(CACHE_PATHS[path], do_sample=False, pad_token_id=0, eos_token_id=None)
    uncached_settings = {k: v for k, v in settings.items() if k not in ("cache_implementation",)}
    if "prompt_lookup_num_tokens" in uncached_settings:  # assisted decoding needs a cache; its reference is greedy
        uncached_settings.pop("prompt_lookup_num_tokens")
    cached = model.generate(prompt, **settings)
    uncached = model.generate(prompt, use_cache=False, **uncached_settings)
    assert torch.equal(cached, uncached), path


@pytest.mark.slow
@pytest.mark.parametrize("variant", ["learnable_plus", "dense", "svformer", "neutreno", "gated"])
def test_compiled_static_cache_generates_the_uncached_tokens(variant):
    model = model_for(variant)
    prompt = torch.randint(3, 128, (1, 6))
    compiled = model.generate(prompt, cache_implementation="static", compile_config=CompileConfig(fullgraph=True),
                              max_new_tokens=12, do_sample=False, pad_token_id=0, eos_token_id=None)
    uncached = model.generate(prompt, use_cache=False, max_new_tokens=12, do_sample=False, pad_token_id=0,
                              eos_token_id=None)
    assert torch.equal(compiled, uncached)
