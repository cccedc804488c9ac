"""transformers' model-type name tables list "resformer" wherever they list "llama", and what reads them treats a
ResFormer as a Llama: the Trainer's label-smoothing loss (labels shifted for causal LMs only), model-card task tags.

Reference: an HF `LlamaForCausalLM` with the same weights, whose ResFormer twin starts at the output-preserving λ, so
the two compute the same function and every difference is the client's handling of the model type.
"""

from __future__ import annotations

import pytest
import torch
import transformers
from transformers import Trainer
from transformers.modelcard import TrainingSummary
from transformers.models.auto import modeling_auto

import resformer_hf
from resformer_hf.remote_code.modeling_resformer import MODEL_TYPE_NAME_TABLES, register_model_type_names

from helpers import llama_pair, model_with_random_lambdas, tiny_config, training_arguments


def tables_listing_llama() -> dict[str, dict]:
    """Every model-type → class-name table of transformers' modeling Auto module that lists "llama"."""
    return {
        name: table
        for name, table in vars(modeling_auto).items()
        if name.isupper() and isinstance(table, dict) and "llama" in table and name != "CONFIG_MAPPING_NAMES"
    }


def test_every_table_that_lists_llama_lists_resformer_with_the_matching_class():
    tables = tables_listing_llama()
    assert {"MODEL_MAPPING_NAMES", "MODEL_FOR_CAUSAL_LM_MAPPING_NAMES"} <= set(tables)
    assert set(tables) == set(MODEL_TYPE_NAME_TABLES)
    for name, table in tables.items():
        llama_class = table["llama"]
        assert table.get("resformer") == llama_class.replace("Llama", "ResFormer"), name
        assert hasattr(resformer_hf, table["resformer"]), name


def test_registration_is_idempotent_and_keeps_the_auto_mappings_importable():
    before = {name: dict(table) for name, table in tables_listing_llama().items()}
    resformer_hf.register_auto_classes()
    register_model_type_names()
    assert {name: dict(table) for name, table in tables_listing_llama().items()} == before
    # The lazy Auto mappings import transformers.models.<type> for listed types they also find in CONFIG_MAPPING_NAMES;
    # "resformer" must not be there, or listing their keys would try to import transformers.remote_code.
    assert "resformer" not in modeling_auto.CONFIG_MAPPING_NAMES
    assert resformer_hf.ResFormerForCausalLM in modeling_auto.MODEL_FOR_CAUSAL_LM_MAPPING.values()
    assert resformer_hf.ResFormerConfig in modeling_auto.MODEL_FOR_CAUSAL_LM_MAPPING


def label_smoothing_loss(model, input_ids: torch.Tensor, output_dir) -> float:
    trainer = Trainer(model=model, args=training_arguments(output_dir, label_smoothing_factor=0.1))
    with torch.no_grad():
        return trainer.compute_loss(model, {"input_ids": input_ids, "labels": input_ids}).item()


def test_label_smoothing_loss_equals_llamas(tmp_path, monkeypatch):
    llama, resformer = llama_pair("learnable_plus")
    input_ids = torch.randint(3, 128, (2, 16))
    loss = label_smoothing_loss(resformer, input_ids, tmp_path)
    assert loss == pytest.approx(label_smoothing_loss(llama, input_ids, tmp_path), abs=1e-6)

    # Without the table entry the Trainer silently smooths against unshifted labels: the test can tell.
    monkeypatch.delitem(modeling_auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES, "resformer")
    assert abs(label_smoothing_loss(resformer, input_ids, tmp_path) - loss) > 1e-3


@pytest.mark.parametrize("variant", ["learnable_plus", "svformer", "dense", "gated"])
def test_label_smoothing_trains_on_next_token_targets(variant, tmp_path):
    model = model_with_random_lambdas(tiny_config(variant))
    input_ids = torch.randint(3, 128, (2, 16))
    with torch.no_grad():
        logits = model(input_ids).logits
    next_token = torch.nn.functional.cross_entropy(
        logits[:, :-1].flatten(0, 1), input_ids[:, 1:].flatten(), label_smoothing=0.1
    )
    assert label_smoothing_loss(model, input_ids, tmp_path) == pytest.approx(next_token.item(), rel=1e-5)


@pytest.mark.parametrize("head", ["ResFormerForCausalLM", "ResFormerForSequenceClassification"])
def test_trainer_model_card_infers_the_task_as_for_llama(head, tmp_path):
    llama, resformer = llama_pair()
    model = getattr(resformer_hf, head)(resformer.config)
    twin = getattr(transformers, head.replace("ResFormer", "Llama"))(llama.config)
    tasks = {}
    for name, candidate in (("resformer", model), ("llama", twin)):
        trainer = Trainer(model=candidate, args=training_arguments(tmp_path / name))
        tasks[name] = TrainingSummary.from_trainer(trainer).tasks
    assert tasks["resformer"] == tasks["llama"] is not None
