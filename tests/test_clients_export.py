"""Export clients on converted checkpoints, the source Llama as the control: ExecuTorch-style export with a static
cache (`transformers.integrations.executorch`), `torch.export` with a dynamic cache, and ONNX through
`torch.onnx.export(dynamo=True)` run by onnxruntime. Reference: the same model run eagerly."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, DynamicCache, GenerationConfig
from transformers.integrations.executorch import TorchExportableModuleForDecoderOnlyLM, export_with_dynamic_cache

from resformer_hf.remote_code._compat import cache_of, with_cache

MAX_CACHE_LEN = 32


def load(folder) -> torch.nn.Module:
    return AutoModelForCausalLM.from_pretrained(folder).eval()


def eager_logits(model, input_ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids).logits


@pytest.mark.slow
@pytest.mark.parametrize("name", ["llama", "learnable_plus", "svformer", "dense"])
def test_executorch_static_cache_export_decodes_like_eager(name, client_folders):
    model = load(client_folders[name])
    model.generation_config = GenerationConfig(
        use_cache=True, cache_implementation="static",
        cache_config={"batch_size": 1, "max_cache_len": MAX_CACHE_LEN, "device": "cpu"},
    )
    program = TorchExportableModuleForDecoderOnlyLM(model).export(
        input_ids=torch.tensor([[5]]), cache_position=torch.tensor([0])
    )
    input_ids = torch.randint(3, model.config.vocab_size, (1, 10))
    module = program.module()
    steps = [module(input_ids=input_ids[:, i : i + 1], cache_position=torch.tensor([i])) for i in range(10)]
    torch.testing.assert_close(torch.cat(steps, dim=1), eager_logits(model, input_ids), rtol=1e-5, atol=1e-5)

    # A runner's greedy loop on the same (reused) program gives `generate()`'s tokens. Not transformers'
    # `TorchExportableModuleWithStaticCache.generate`: in 5.23 it feeds the first new token at position
    # prompt_len + 1, leaving a hole in the cache, and misses greedy tokens for Llama too.
    prompt = input_ids[:, :4]
    expected = model.generate(prompt, max_new_tokens=6, do_sample=False, cache_implementation="dynamic")
    assert torch.equal(runner_greedy(module, prompt, 6), expected)


def runner_greedy(module, prompt: torch.Tensor, new_tokens: int) -> torch.Tensor:
    """Token-by-token prefill, then greedy decoding, as an ExecuTorch LLM runner drives the exported program."""
    tokens = prompt[0].tolist()
    for position in range(len(tokens) + new_tokens - 1):
        logits = module(input_ids=torch.tensor([[tokens[position]]]), cache_position=torch.tensor([position]))
        if position >= len(prompt[0]) - 1:
            tokens.append(int(logits[0, -1].argmax()))
    return torch.tensor([tokens])


@pytest.mark.slow
@pytest.mark.parametrize("name", ["llama", "learnable_plus", "svformer"])
def test_torch_export_with_a_dynamic_cache_matches_eager(name, client_folders):
    model = load(client_folders[name])
    input_ids = torch.randint(3, model.config.vocab_size, (2, 9))
    mask = torch.ones_like(input_ids)
    program = export_with_dynamic_cache(model, input_ids, mask)
    outputs = program.module()(input_ids=input_ids, attention_mask=mask,
                               **with_cache(DynamicCache(config=model.config)), use_cache=True)
    torch.testing.assert_close(outputs.logits, eager_logits(model, input_ids), rtol=1e-5, atol=1e-5)
    with torch.no_grad():
        eager = cache_of(model(input_ids, use_cache=True))
    assert cache_of(outputs).get_seq_length() == eager.get_seq_length() == 9
    for exported_layer, eager_layer in zip(cache_of(outputs).layers, eager.layers):
        torch.testing.assert_close(exported_layer.keys, eager_layer.keys)
        torch.testing.assert_close(exported_layer.values, eager_layer.values)


class _LogitsOnly(torch.nn.Module):
    """The causal LM as ONNX sees it: token ids in, logits out (no cache objects at the graph boundary)."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, input_ids):
        return self.model(input_ids=input_ids, use_cache=False).logits


@pytest.mark.slow
@pytest.mark.parametrize("name", ["llama", "learnable_plus", "svformer"])
def test_onnx_export_runs_in_onnxruntime_like_eager(name, client_folders, tmp_path):
    onnxruntime = pytest.importorskip("onnxruntime", reason="onnxruntime is in the `clients` extra")
    pytest.importorskip("onnxscript", reason="torch.onnx.export(dynamo=True) needs onnxscript (`clients` extra)")
    model = load(client_folders[name])
    example = torch.randint(3, model.config.vocab_size, (2, 7))
    dims = {0: torch.export.Dim("batch"), 1: torch.export.Dim("sequence")}
    program = torch.onnx.export(_LogitsOnly(model), (example,), dynamo=True, input_names=["input_ids"],
                                output_names=["logits"], dynamic_shapes={"input_ids": dims}, verbose=False)
    program.save(tmp_path / "model.onnx")
    session = onnxruntime.InferenceSession(str(tmp_path / "model.onnx"), providers=["CPUExecutionProvider"])
    input_ids = torch.randint(3, model.config.vocab_size, (3, 11))  # another shape than the example
    (logits,) = session.run(None, {"input_ids": input_ids.numpy()})
    torch.testing.assert_close(torch.from_numpy(logits), eager_logits(model, input_ids), rtol=1e-4, atol=1e-5)
