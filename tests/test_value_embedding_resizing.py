"""Value-embedding tables follow a vocabulary change (issue 68): `resize_token_embeddings` gives every table
`embed_tokens`' new row count, old rows kept and new rows at zero, whatever the call (`mean_resizing` on or off,
`pad_to_multiple_of`, shrinking, padding only).

The control is a Llama with the same weights (`llama_pair`), resized by the same call under the same seed: its
`embed_tokens` sets the row count every table must have, and its outputs are what a ResFormer whose tables hold
trained (random) rows gives on new tokens alone, since a zero row adds nothing to a token's values.
"""

from __future__ import annotations

import pytest
import torch

from resformer_hf import ResFormerForCausalLM, ResFormerModel

from helpers import llama_pair, run_fresh_python, tiny_config

VOCAB = 128  # helpers.TINY
#: resize_token_embeddings calls: (new_num_tokens, keyword arguments), growing, shrinking, padding only, unchanged
CALLS = [(160, {}), (160, {"mean_resizing": False}), (130, {"pad_to_multiple_of": 64}),
         (None, {"pad_to_multiple_of": 48}), (100, {}), (VOCAB, {})]


def trained_pair(seed: int = 0):
    """(Llama, ResFormer `none` with tables in layers 1 and 3): the same weights, plus tables and gates off zero."""
    llama, model = llama_pair("none", seed=seed, value_embeddings="alternating")
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if "value_embedding" in name:
                parameter.normal_(0.0, 0.5)
    return llama, model


def tables(model) -> dict[int, torch.nn.Embedding]:
    return {n: layer.self_attn.value_embedding for n, layer in enumerate(model.base_model.layers)
            if layer.self_attn.has_value_embedding}


@pytest.mark.parametrize(("new_num_tokens", "options"), CALLS, ids=[f"{n}-{o}" for n, o in CALLS])
def test_tables_follow_every_resize_as_llamas_embed_tokens_does(new_num_tokens, options):
    llama, model = trained_pair()
    before = {n: table.weight.detach().clone() for n, table in tables(model).items()}
    old_ids = torch.randint(3, min(VOCAB, new_num_tokens or VOCAB), (2, 9))
    with torch.no_grad():
        old_logits = model(old_ids).logits
    for resized in (llama, model):
        torch.manual_seed(1)
        resized.resize_token_embeddings(new_num_tokens, **options)
    rows = llama.get_input_embeddings().weight.shape[0]
    assert model.config.vocab_size == llama.config.vocab_size == rows
    kept = min(rows, VOCAB)
    for n, table in tables(model).items():
        assert table.weight.shape == (rows, before[n].shape[1]) and table.num_embeddings == rows, n
        assert torch.equal(table.weight[:kept], before[n][:kept]), n
        assert torch.count_nonzero(table.weight[kept:]) == 0, n
    # transformers' own resize is untouched: the same new embedding and lm_head rows as the Llama's
    assert torch.equal(model.get_input_embeddings().weight, llama.get_input_embeddings().weight)
    assert torch.equal(model.get_output_embeddings().weight, llama.get_output_embeddings().weight)
    with torch.no_grad():
        assert (model(old_ids).logits[..., :kept] - old_logits[..., :kept]).abs().max().item() <= 1e-6
        if rows > VOCAB:  # new tokens alone: no table yet, so the Llama's outputs
            new_ids = torch.randint(VOCAB, rows, (2, 9))
            assert (model(new_ids).logits - llama(new_ids).logits).abs().max().item() <= 1e-5


def test_a_new_tokens_rows_learn_from_the_first_step():
    _, model = trained_pair()
    model.resize_token_embeddings(VOCAB + 8, mean_resizing=False)
    model.train()
    input_ids = torch.tensor([[5, VOCAB + 3, 7, VOCAB + 6, 9]])
    model(input_ids, labels=input_ids).loss.backward()
    for n, table in tables(model).items():
        touched = set((table.weight.grad.abs().sum(-1) > 0).nonzero().flatten().tolist())
        assert touched == {5, 7, VOCAB + 3, VOCAB + 6}, n  # the last token's values reach no loss


def test_the_base_model_resizes_its_tables_too():
    model = ResFormerModel(tiny_config("learnable_plus", value_embeddings="u_net"))
    model.resize_token_embeddings(VOCAB + 5, pad_to_multiple_of=16)
    assert {tuple(table.weight.shape) for table in tables(model).values()} == {(VOCAB + 16, 16)}


def test_a_resized_checkpoint_loads_with_its_tables(tmp_path):
    _, model = trained_pair()
    model.resize_token_embeddings(VOCAB + 32)
    model.save_pretrained(tmp_path)
    loaded = ResFormerForCausalLM.from_pretrained(tmp_path).eval()
    input_ids = torch.tensor([[4, VOCAB + 1, 8, VOCAB + 31]])
    with torch.no_grad():
        assert torch.equal(loaded(input_ids).logits, model(input_ids).logits)


def test_remote_code_resizes_the_tables(tmp_path):
    """The override ships in the copied remote code: a Hub user without the plugin gets it."""
    _, model = trained_pair()
    model.save_pretrained(tmp_path / "model")
    report = run_fresh_python(
        """
        import json, sys, torch
        from transformers import AutoModelForCausalLM
        model = AutoModelForCausalLM.from_pretrained(sys.argv[1], trust_remote_code=True)
        model.resize_token_embeddings(200)
        shapes = [list(m.weight.shape) for name, m in model.named_modules() if name.endswith("value_embedding")]
        print("REPORT " + json.dumps({"shapes": shapes, "logits": list(model(torch.tensor([[199]])).logits.shape)}))
        """,
        tmp_path, str(tmp_path / "model"),
    )
    assert report == {"shapes": [[200, 16], [200, 16]], "logits": [1, 1, 200]}
