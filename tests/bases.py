"""The bases users start from (issue 67), one tiny source model each, built and saved by transformers' own classes:
what sets each apart from Llama is kept (Qwen 3's q/k norms, SmolLM3's NoPE layers, OLMo 2's post-norms, Gemma 3's
four norms, windows and RoPE per layer type, Mistral's window), every weight off its init value, norms included.
Windows are 6 tokens, so every prompt the tests use is longer than them. Imported by name (`from bases import ...`).
"""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig

from resformer_hf import convert_llama_checkpoint
from resformer_hf.text import sample_text, train_tokenizer

#: The size every base is built at: 4 layers, GQA (4 query heads, 2 kv heads), head size 16 unless a base sets one.
SIZE = dict(vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=128, initializer_range=0.1)
WINDOW = 6
SLIDING, FULL = "sliding_attention", "full_attention"
#: name -> (model_type, its fields beyond `SIZE`, the ResFormer facts its conversion must have)
BASES = {
    "llama3.2": ("llama", dict(tie_word_embeddings=True, rope_parameters=dict(
        rope_type="llama3", rope_theta=500000.0, factor=32.0, low_freq_factor=1.0, high_freq_factor=4.0,
        original_max_position_embeddings=32)), {}),
    "qwen3": ("qwen3", dict(head_dim=32, tie_word_embeddings=True), dict(qk_norm="head")),
    "smollm3": ("smollm3", dict(no_rope_layer_interval=2), dict(nope_layers=[1, 3])),
    "olmo2": ("olmo2", {}, dict(qk_norm="projection", block_norms="post", rms_norm_type="olmo2",
                                rope_in_float32=True)),
    "olmo3": ("olmo3", dict(sliding_window=WINDOW), dict(
        qk_norm="projection", block_norms="post", rms_norm_type="olmo2", rope_in_float32=True,
        layer_types=[SLIDING, SLIDING, SLIDING, FULL], sliding_window=WINDOW)),
    "gemma3": ("gemma3_text", dict(head_dim=16, query_pre_attn_scalar=12, sliding_window=WINDOW,
                                   tie_word_embeddings=True, layer_types=[SLIDING, FULL, SLIDING, FULL]),
               dict(qk_norm="head", block_norms="sandwich", rms_norm_type="gemma3", embedding_multiplier=8.0,
                    query_pre_attn_scalar=12, layer_types=[SLIDING, FULL, SLIDING, FULL])),
    "mistral": ("mistral", dict(sliding_window=WINDOW), dict(layer_types=[SLIDING] * 4, sliding_window=WINDOW)),
}
#: The `ResFormerConfig` fields beyond `SIZE` that describe each base from scratch, written out by hand (what a user
#: pre-training a Qwen 3-shaped ResFormer gives): with the source's weights and no value residual, the source itself.
SCRATCH = {
    "llama3.2": dict(tie_word_embeddings=True, rope_parameters=BASES["llama3.2"][1]["rope_parameters"]),
    "qwen3": dict(head_dim=32, tie_word_embeddings=True, qk_norm="head"),
    "smollm3": dict(nope_layers=[1, 3], rope_parameters=dict(rope_type="default", rope_theta=2000000.0)),
    "olmo2": dict(qk_norm="projection", block_norms="post", rms_norm_type="olmo2", rope_in_float32=True,
                  rms_norm_eps=1e-5),
    "olmo3": dict(qk_norm="projection", block_norms="post", rms_norm_type="olmo2", rope_in_float32=True,
                  rms_norm_eps=1e-5, sliding_window=WINDOW, layer_types=[SLIDING, SLIDING, SLIDING, FULL],
                  rope_parameters={kind: dict(rope_type="default", rope_theta=500000.0) for kind in (FULL, SLIDING)}),
    "gemma3": dict(head_dim=16, tie_word_embeddings=True, qk_norm="head", block_norms="sandwich",
                   rms_norm_type="gemma3", embedding_multiplier=8.0, query_pre_attn_scalar=12, sliding_window=WINDOW,
                   layer_types=[SLIDING, FULL, SLIDING, FULL], hidden_act="gelu_pytorch_tanh",
                   rope_parameters={FULL: dict(rope_type="default", rope_theta=1000000.0),
                                    SLIDING: dict(rope_type="default", rope_theta=10000.0)}),
    "mistral": dict(sliding_window=WINDOW),
}
#: A chat template the converter must carry along unchanged.
CHAT_TEMPLATE = "{% for message in messages %}<{{ message['role'] }}>{{ message['content'] }}{% endfor %}"


def source_model(name: str, **size):
    """The base's model (eval) at `SIZE` with `size` in its place (a head size too), seeded, every weight off init:
    linears at `initializer_range` 0.1, norms moved by ±0.3 from theirs (Gemma's `1 + w` norms from zero), so a
    dropped or misplaced tensor shows in the logits."""
    model_type, fields, _ = BASES[name]
    config = AutoConfig.for_model(model_type, **{**SIZE, **fields, **size}, pad_token_id=0, bos_token_id=1,
                                  eos_token_id=2)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).eval()
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for parameter_name, parameter in model.named_parameters():
            if "norm" in parameter_name:
                parameter.add_(0.3 * torch.randn(parameter.shape, generator=generator))
    return model


def save_source(name: str, folder: Path, **size) -> Path:
    """The base's checkpoint as a user has it: weights, a tokenizer with a chat template, generation defaults."""
    model = source_model(name, **size)
    model.save_pretrained(folder)
    tokenizer = train_tokenizer([sample_text(20_000)], model.config.vocab_size)
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.save_pretrained(folder)
    GenerationConfig(do_sample=True, temperature=0.7, top_p=0.9, bos_token_id=1, eos_token_id=2).save_pretrained(
        folder)
    return folder


def converted(name: str, root: Path, variant: str = "learnable", init: str = "preserve", **options) -> Path:
    """The base's source under `root` (made once), converted to `variant`."""
    source = root / name
    if not (source / "config.json").is_file():
        save_source(name, source)
    destination = root / (f"{name}-{variant}-{init}" + ("-tables" if options.get("value_embeddings") else ""))
    if not (destination / "config.json").is_file():
        convert_llama_checkpoint(source, destination, variant=variant, init=init, progress=False, **options)
    return destination


__all__ = ["BASES", "CHAT_TEMPLATE", "SCRATCH", "SIZE", "WINDOW", "converted", "save_source", "source_model"]
