"""resformer_hf.analysis against plain computations and closed forms (tiny models, CPU)."""

from __future__ import annotations

import math

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from resformer_hf import ResFormerForCausalLM
from resformer_hf.analysis import attention_entropy, lambda_table, token_similarity, value_gate_statistics
from resformer_hf.cli.analyze import main

from helpers import TINY, randomised_model, tiny_config

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _resformer(variant: str = "learnable_plus") -> ResFormerForCausalLM:
    return ResFormerForCausalLM(tiny_config(variant)).eval()


def _llama() -> LlamaForCausalLM:
    return LlamaForCausalLM(LlamaConfig(**TINY)).eval()


def _plain_entropy(attentions, valid: torch.Tensor) -> torch.Tensor:
    """Entropy by explicit loops over batch, head and query (the definition, not the vectorised code)."""
    per_layer = []
    for layer in attentions:
        total, count = 0.0, 0
        for b in range(layer.shape[0]):
            for t in range(layer.shape[2]):
                if not valid[b, t]:
                    continue
                for h in range(layer.shape[1]):
                    p = layer[b, h, t].double()
                    p = p[p > 0]
                    total += float(-(p * p.log()).sum()) / layer.shape[1]
                count += 1
        per_layer.append(total / count)
    return torch.tensor(per_layer, dtype=torch.float64)


def _plain_similarity(states: torch.Tensor, valid: torch.Tensor) -> float:
    """Mean over sequences of the mean cosine over every ordered pair i != j of valid tokens."""
    means = []
    for b in range(states.shape[0]):
        tokens = states[b][valid[b]].double()
        sims = [
            float(torch.nn.functional.cosine_similarity(tokens[i], tokens[j], dim=0))
            for i in range(len(tokens))
            for j in range(len(tokens))
            if i != j
        ]
        means.append(sum(sims) / len(sims))
    return sum(means) / len(means)


@pytest.mark.parametrize("build", [_resformer, _llama], ids=["resformer", "llama"])
def test_attention_entropy_matches_plain_loops_and_restores_sdpa(build):
    model = build()
    input_ids = torch.randint(3, TINY["vocab_size"], (2, 9))
    mask = torch.ones_like(input_ids)
    mask[1, 6:] = 0  # right padding on the second sequence
    assert model.config._attn_implementation == "sdpa"
    got = attention_entropy(model, input_ids, mask)
    assert model.config._attn_implementation == "sdpa"  # switched back after the eager pass

    model.set_attn_implementation("eager")
    with torch.no_grad():
        attentions = model(input_ids=input_ids, attention_mask=mask, output_attentions=True).attentions
    expected = _plain_entropy(attentions, mask.bool())
    assert got.shape == (TINY["num_hidden_layers"],)
    torch.testing.assert_close(got.double(), expected, atol=1e-5, rtol=0)


def test_attention_entropy_of_uniform_causal_attention_is_mean_log_prefix_length():
    """Zero query/key weights make every head attend uniformly to its causal prefix: H(t) = log(t + 1)."""
    model = _resformer("identity")
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.q_proj.weight.zero_()
            layer.self_attn.k_proj.weight.zero_()
    T = 12
    got = attention_entropy(model, torch.randint(3, TINY["vocab_size"], (3, T)))
    expected = sum(math.log(t + 1) for t in range(T)) / T
    torch.testing.assert_close(got, torch.full((TINY["num_hidden_layers"],), expected), atol=1e-5, rtol=0)


def test_value_residual_leaves_layer_zero_entropy_unchanged():
    """Layers 0 and 1 see the same hidden states in both models (only layer 1's values differ), so on Llama's own
    weights their attention is Llama's; from layer 2 on the mixed values change what attention sees."""
    resformer = ResFormerForCausalLM(tiny_config("learnable_plus", initializer_range=0.5)).eval()
    llama = LlamaForCausalLM(LlamaConfig(**TINY, initializer_range=0.5)).eval()
    missing = llama.load_state_dict(resformer.state_dict(), strict=False)
    assert not missing.missing_keys
    input_ids = torch.randint(3, TINY["vocab_size"], (2, 10))
    ours, theirs = attention_entropy(resformer, input_ids), attention_entropy(llama, input_ids)
    torch.testing.assert_close(ours[:2], theirs[:2], atol=1e-5, rtol=0)
    assert (ours[2:] - theirs[2:]).abs().min() > 1e-3  # later layers do see V_0


def test_token_similarity_matches_pairwise_cosines_with_padding():
    model = _resformer("dense")
    input_ids = torch.randint(3, TINY["vocab_size"], (2, 8))
    mask = torch.ones_like(input_ids)
    mask[0, 5:] = 0
    got = token_similarity(model, input_ids, mask)
    with torch.no_grad():
        hidden = model(input_ids=input_ids, attention_mask=mask, output_hidden_states=True).hidden_states
    expected = torch.tensor([_plain_similarity(h, mask.bool()) for h in hidden], dtype=torch.float64)
    assert got.shape == (TINY["num_hidden_layers"] + 1,)
    torch.testing.assert_close(got.double(), expected, atol=1e-5, rtol=0)
    # Right padding is invisible to causal attention: the padded row scores as the unpadded sequence alone.
    alone = token_similarity(model, input_ids[:1, :5])
    second = token_similarity(model, input_ids[1:])
    torch.testing.assert_close(got, (alone + second) / 2, atol=1e-5, rtol=0)


def test_token_similarity_of_repeated_token_is_one():
    """The same token at every position gives identical values, hence identical hidden states: cosine 1 everywhere."""
    model = _resformer("learnable")
    got = token_similarity(model, torch.full((1, 7), 5))
    torch.testing.assert_close(got, torch.ones(TINY["num_hidden_layers"] + 1), atol=1e-5, rtol=0)


def test_lambda_table_closed_forms():
    L = TINY["num_hidden_layers"]
    llama_table = lambda_table(_llama())
    torch.testing.assert_close(llama_table, torch.tensor([[0.0, 1.0]] * L))

    model = _resformer("learnable_plus")
    logits = torch.tensor([0.3, -1.0, 2.0])
    with torch.no_grad():
        model.model.value_residual.lambda_logits.copy_(logits)
        model.model.value_residual.lambda_scale_offset.fill_(0.5)
    table = lambda_table(model)
    expected_first = (L + 0.5) * torch.exp(logits) / torch.exp(logits).sum()
    torch.testing.assert_close(table[1:, 0], expected_first)
    torch.testing.assert_close(table[:, 1], torch.tensor([1.0, 0.5, 0.5, 0.5]))
    assert table[0, 0] == 0.0


def _save_tokenizer(path) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = "the of and to a in that is was he for it with as his on be at by i".split()
    vocab = {"[UNK]": 0, **{w: i + 3 for i, w in enumerate(words)}}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tokenizer, unk_token="[UNK]").save_pretrained(path)


def test_cli_writes_summary_and_plots_with_the_functions_numbers(tmp_path):
    resformer, llama = _resformer("learnable_plus"), _llama()
    resformer.save_pretrained(tmp_path / "resformer")
    llama.save_pretrained(tmp_path / "llama")
    _save_tokenizer(tmp_path / "resformer")
    text = tmp_path / "text.txt"
    text.write_text("the cat sat on a mat and it was at the door of his house with a hat " * 4)
    out = tmp_path / "out"

    assert main([str(tmp_path / "resformer"), str(tmp_path / "llama"), "--text", str(text), "--out", str(out),
                 "--max-tokens", "16", "--num-sequences", "2"]) == 0

    summary = (out / "summary.md").read_text()
    for name in ("attention_entropy.png", "token_similarity.png", "lambdas.png"):
        assert (out / name).read_bytes()[:8] == PNG_MAGIC
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tmp_path / "resformer")
    ids = tokenizer(text.read_text(), add_special_tokens=False)["input_ids"]
    batch = torch.tensor(ids[:32]).view(2, 16)
    for model in (resformer, llama):
        row_entropy = " | ".join(f"{v:.3f}" for v in attention_entropy(model, batch).tolist())
        row_similarity = " | ".join(f"{v:.3f}" for v in token_similarity(model, batch).tolist())
        assert row_entropy in summary and row_similarity in summary
    assert "learnable_plus" in summary and "none (Llama)" in summary


def test_cli_errors_say_what_to_do(tmp_path, capsys):
    _llama().save_pretrained(tmp_path / "llama")  # no tokenizer saved with it
    text = tmp_path / "t.txt"
    text.write_text("some words here")
    capsys.readouterr()
    assert main([str(tmp_path / "llama"), "--text", str(text), "--out", str(tmp_path / "o"), "--no-plots"]) == 2
    assert "pass --tokenizer PATH" in capsys.readouterr().err
    assert main([str(tmp_path / "llama"), "--text", str(tmp_path / "missing.txt"), "--out", str(tmp_path / "o")]) == 2
    assert capsys.readouterr().err.strip().endswith("missing.txt is not a file; pass a UTF-8 text file.")
    assert not (tmp_path / "o").exists()


def test_value_gate_statistics_follow_the_gates_equation_on_each_layers_input():
    """Mean, spread and range of `g = g0 − 1/2 + σ(W_g h[..., :12] + b_g)` over the valid tokens and kv heads of each
    gated layer, with h that layer's normalised input recomputed here from the hidden states the model returns."""
    model = randomised_model("gated", initializer_range=0.2)  # layers 1 and 3, g0 = 0.3, random gates
    input_ids = torch.randint(3, 128, (2, 9))
    mask = torch.ones_like(input_ids)
    mask[1, :4] = 0  # left padding: those tokens do not count
    statistics = value_gate_statistics(model, input_ids, mask)
    assert sorted(statistics) == [1, 3]
    with torch.no_grad():
        states = model(input_ids, attention_mask=mask, output_hidden_states=True).hidden_states
    for layer, found in statistics.items():
        block = model.model.layers[layer]
        normed = block.input_layernorm(states[layer])
        gate = block.self_attn.value_gate
        expected = (0.3 - 0.5 + torch.sigmoid(normed[..., :12] @ gate.weight.T + gate.bias))[mask.bool()]
        assert found == pytest.approx({"mean": expected.mean().item(), "std": expected.std(correction=0).item(),
                                       "min": expected.min().item(), "max": expected.max().item()}, abs=1e-6)
        assert found["std"] > 1e-3  # the mix really depends on the token
    fresh = value_gate_statistics(_resformer("gated"), input_ids)  # zero gates: every token at g0 = 0.5
    assert fresh == {layer: {"mean": 0.5, "std": 0.0, "min": 0.5, "max": 0.5} for layer in (1, 2, 3)}
    assert value_gate_statistics(_resformer("learnable_plus"), input_ids) == {}
