"""Generation clients on converted checkpoints, each checked the same way on the source Llama (the control):
`pipeline("text-generation")`, `TextStreamer`, assisted decoding, prompt lookup and the static cache all produce what
plain greedy `generate()` produces, and a conversion that preserves the source's outputs generates the Llama's text.
"""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, TextStreamer, pipeline

MODELS = ("llama", "learnable_plus", "svformer")
PROMPT = "It is a truth universally acknowledged, that a single man"
NEW_TOKENS = 12


@pytest.fixture(scope="module")
def load(client_folders):
    cache = {}

    def load_model(name: str):
        if name not in cache:
            model = AutoModelForCausalLM.from_pretrained(client_folders[name]).eval()
            cache[name] = (model, AutoTokenizer.from_pretrained(client_folders[name]))
        return cache[name]

    return load_model


def greedy(model, input_ids, **kwargs) -> torch.Tensor:
    return model.generate(input_ids, max_new_tokens=NEW_TOKENS, do_sample=False, **kwargs)


@pytest.mark.parametrize("name", MODELS)
def test_pipeline_and_text_streamer_give_greedy_generate_text(name, load, capsys):
    model, tokenizer = load(name)
    input_ids = tokenizer(PROMPT, return_tensors="pt").input_ids
    expected = tokenizer.decode(greedy(model, input_ids)[0], skip_special_tokens=True)

    generator = pipeline("text-generation", model=model, tokenizer=tokenizer)
    assert generator(PROMPT, max_new_tokens=NEW_TOKENS, do_sample=False)[0]["generated_text"] == expected

    capsys.readouterr()
    greedy(model, input_ids, streamer=TextStreamer(tokenizer, skip_special_tokens=True))
    assert capsys.readouterr().out.rstrip("\n") == expected


@pytest.mark.slow
@pytest.mark.parametrize("name", MODELS)
def test_assisted_decoding_prompt_lookup_and_static_cache_match_greedy(name, load):
    model, tokenizer = load(name)
    assistant, _ = load("svformer" if name == "llama" else "llama")  # a different draft model: rejections happen
    input_ids = tokenizer(PROMPT + " " + PROMPT, return_tensors="pt").input_ids  # repeats: prompt lookup finds drafts
    expected = greedy(model, input_ids)
    assert torch.equal(greedy(model, input_ids, assistant_model=assistant), expected)
    assert torch.equal(greedy(model, input_ids, prompt_lookup_num_tokens=3), expected)
    assert torch.equal(greedy(model, input_ids, cache_implementation="static"), expected)


def test_an_output_preserving_conversion_generates_the_llamas_text(load):
    llama, tokenizer = load("llama")
    converted, _ = load("resformer_preserve")
    texts = {}
    for name, model in (("llama", llama), ("converted", converted)):
        generator = pipeline("text-generation", model=model, tokenizer=tokenizer)
        texts[name] = generator(PROMPT, max_new_tokens=NEW_TOKENS, do_sample=False)[0]["generated_text"]
    assert texts["converted"] == texts["llama"] and len(texts["llama"]) > len(PROMPT)
