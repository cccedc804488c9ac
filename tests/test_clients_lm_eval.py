"""lm-eval (EleutherAI's harness, `hf` backend) on converted checkpoints: a conversion that preserves the source's
outputs scores exactly what the source Llama scores, sample by sample, and an SVFormer's per-choice log-likelihoods
equal the ones computed directly from the model. The task is a local multiple-choice file (offline)."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

DOCS = [
    {"text": "It is a truth universally acknowledged,", "choices": [" that a single man", " the queen", " a layer"]},
    {"text": "To be, or not to be,", "choices": [" that is the question", " said Mr. Bennet", " in Denmark"]},
    {"text": "Mr. Bennet was among the earliest", "choices": [" of those who waited", " of the players", " ghosts"]},
    {"text": "Something is rotten in the state", "choices": [" of Denmark", " of Netherfield", " of mind"]},
]


def evaluate(folder, docs_path) -> list[dict]:
    lm_eval = pytest.importorskip("lm_eval", reason="lm-eval is in the `clients` extra")
    task = {
        "task": "resformer_toy_choice", "dataset_path": "json", "test_split": "test",
        "dataset_kwargs": {"data_files": {"test": str(docs_path)}}, "output_type": "multiple_choice",
        "doc_to_text": "{{text}}", "doc_to_choice": "{{choices}}", "doc_to_target": 0, "target_delimiter": "",
        "metric_list": [{"metric": "acc"}],
    }
    from lm_eval.tasks import TaskManager

    results = lm_eval.simple_evaluate(
        model="hf", model_args={"pretrained": str(folder), "device": "cpu", "dtype": "float32"}, tasks=[task],
        batch_size=8, log_samples=True, bootstrap_iters=0,
        task_manager=TaskManager(include_defaults=False),  # indexing the thousands of built-in tasks takes minutes
    )
    return results["samples"]["resformer_toy_choice"]


def loglikelihoods(samples: list[dict]) -> list[float]:
    """Every (sample, choice) log-likelihood, in order."""
    return [choice[0][0] for sample in samples for choice in sample["resps"]]


@pytest.fixture(scope="module")
def docs_path(tmp_path_factory):
    path = tmp_path_factory.mktemp("lm_eval") / "docs.jsonl"
    path.write_text("\n".join(json.dumps(doc) for doc in DOCS))
    return path


@pytest.mark.slow
def test_converted_checkpoint_scores_what_the_source_scores_sample_by_sample(client_folders, docs_path):
    source = evaluate(client_folders["llama"], docs_path)
    converted = evaluate(client_folders["resformer_preserve"], docs_path)
    assert len(source) == len(converted) == len(DOCS)
    for ours, theirs in zip(converted, source):
        assert ours["doc"] == theirs["doc"] and ours["acc"] == theirs["acc"]
    assert loglikelihoods(converted) == pytest.approx(loglikelihoods(source), abs=1e-4)


@pytest.mark.slow
def test_svformer_log_likelihoods_are_the_models_own(client_folders, docs_path):
    folder = client_folders["svformer"]
    samples = evaluate(folder, docs_path)
    model = AutoModelForCausalLM.from_pretrained(folder).eval()
    tokenizer = AutoTokenizer.from_pretrained(folder)
    expected = []
    for doc in DOCS:
        context = tokenizer(doc["text"]).input_ids
        for choice in doc["choices"]:
            whole = tokenizer(doc["text"] + choice).input_ids  # lm-eval's encoding: the continuation is the rest
            with torch.no_grad():
                log_probs = model(torch.tensor([whole[:-1]])).logits[0].log_softmax(-1)
            expected.append(sum(log_probs[i - 1, whole[i]].item() for i in range(len(context), len(whole))))
    assert loglikelihoods(samples) == pytest.approx(expected, abs=1e-3)
