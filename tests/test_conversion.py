"""Llama → ResFormer conversion: real checkpoints written by transformers, converted, then compared with the source
model itself (the independent reference) on the same input; bad inputs give one-line errors and never touch SRC."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from transformers import (
    AutoModelForCausalLM,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
)

from resformer_hf import ConversionError, ResFormerForCausalLM, convert_llama_checkpoint
from resformer_hf.cli.convert import main as cli_main
from resformer_hf.hub import SAMPLING_DEFAULTS
from resformer_hf.registration import full_auto_map
from resformer_hf.text import sample_text

REPO = Path(__file__).resolve().parents[1]

SMALL = dict(
    vocab_size=160,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,  # GQA
    max_position_embeddings=64,
)


def _save(model, directory: Path, **kwargs) -> Path:
    # Non-zero biases so that a dropped or zeroed source bias would show in the logits.
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if name.endswith("bias"):
                parameter.normal_(0, 0.5)
    model.save_pretrained(directory, **kwargs)
    return directory


def make_checkpoint(root: Path, kind: str) -> Path:
    """A real checkpoint written by transformers' own save_pretrained."""
    directory = root / f"src-{kind}"
    if kind == "llama-sharded":
        model = LlamaForCausalLM(LlamaConfig(**SMALL, tie_word_embeddings=False))
        return _save(model, directory, max_shard_size="24KB")
    if kind == "llama-tied":
        return _save(LlamaForCausalLM(LlamaConfig(**SMALL, tie_word_embeddings=True)), directory)
    if kind == "llama-bf16":
        model = LlamaForCausalLM(LlamaConfig(**SMALL, attention_bias=True, mlp_bias=True)).to(torch.bfloat16)
        return _save(model, directory, max_shard_size="48KB")
    if kind == "mistral":
        config = MistralConfig(**SMALL, sliding_window=None, head_dim=16)  # head_dim != hidden / heads
        return _save(MistralForCausalLM(config), directory)
    if kind == "qwen2":
        return _save(Qwen2ForCausalLM(Qwen2Config(**SMALL, tie_word_embeddings=True)), directory)
    raise ValueError(kind)


def tree_hash(directory: Path) -> dict[str, str]:
    return {
        str(path.relative_to(directory)): hashlib.sha256(path.read_bytes()).hexdigest()
        for path in sorted(directory.rglob("*"))
        if path.is_file()
    }


def probe_ids(vocab_size: int) -> torch.Tensor:
    return torch.randint(0, vocab_size, (2, 12), generator=torch.Generator().manual_seed(1))


def logits_of(directory: Path, ids: torch.Tensor, **kwargs) -> torch.Tensor:
    model = AutoModelForCausalLM.from_pretrained(directory, dtype="auto", **kwargs).eval()
    with torch.no_grad():
        mask = torch.ones_like(ids)
        mask[1, :3] = 0  # left padding in the second row exercises the mask path too
        return model(input_ids=ids, attention_mask=mask).logits


@pytest.fixture(scope="module")
def sources(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("sources")
    torch.manual_seed(0)
    return {kind: make_checkpoint(root, kind)
            for kind in ("llama-sharded", "llama-tied", "llama-bf16", "mistral", "qwen2")}


# ---- function-preserving conversion ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kind, variant",
    [
        ("llama-sharded", "learnable"),
        ("llama-tied", "learnable_plus"),
        ("llama-bf16", "learnable"),
        ("mistral", "learnable_plus"),
        ("qwen2", "learnable"),
        ("llama-bf16", "gated"),
        ("qwen2", "gated"),
    ],
)
def test_preserving_conversion_matches_source(sources, tmp_path, kind, variant):
    src = sources[kind]
    before = tree_hash(src)
    dst = tmp_path / "converted"
    report = convert_llama_checkpoint(src, dst, variant=variant, progress=False)
    assert tree_hash(src) == before, "the source must not change"
    assert report.dst == dst.absolute() and report.variant == variant and report.init == "preserve"

    ids = probe_ids(SMALL["vocab_size"])
    expected = logits_of(src, ids)
    converted = AutoModelForCausalLM.from_pretrained(dst, dtype="auto")
    assert isinstance(converted, ResFormerForCausalLM) and converted.config.value_residual == variant
    assert converted.dtype == expected.dtype  # bf16 stays bf16
    actual = logits_of(dst, ids)
    # Exact in every dtype: the weights are copied bit for bit and λ = (0, 1) mixes with exact multiplies by 0 and 1.
    # (Scaling the bf16 weights by 1.01 in the writer moved the logits by only 0.004, under a 1e-2 tolerance.)
    assert torch.equal(actual, expected), (actual.float() - expected.float()).abs().max()

    # The λ (and value gates) sit at the exact-Llama point and are written explicitly (no "newly initialised" keys).
    lambdas = converted.value_residual_lambdas()
    assert torch.equal(lambdas[1:], torch.tensor([[0.0, 1.0]] * (SMALL["num_hidden_layers"] - 1)))
    stored = _stored_tensors(dst)
    mixing = ("model.value_residual.", ".value_gate.")
    assert {name for name in stored if any(part in name for part in mixing)} == {
        name for name, _ in converted.named_parameters() if any(part in name for part in mixing)
    }
    if variant == "gated":  # zero gates, float32 like the λ: every token's mix starts at g0 = 0
        gates = {name: p for name, p in converted.named_parameters() if ".value_gate." in name}
        assert len(gates) == 2 * (SMALL["num_hidden_layers"] - 1)
        assert all(p.dtype == torch.float32 and not p.any() for p in gates.values())
    assert report.num_tensors == len(stored)
    if kind == "qwen2":  # Llama's attention_bias adds an o_proj bias that Qwen2 lacks: it must be exactly zero
        assert converted.config.attention_bias
        assert all(not layer.self_attn.o_proj.bias.any() for layer in converted.model.layers)
        assert set(report.added_tensors) >= {f"model.layers.{i}.self_attn.o_proj.bias" for i in range(3)}

    # The λ (the gates) are trainable from here: one backward pass reaches them with a non-zero gradient.
    converted.float().train()
    loss = converted(input_ids=ids, labels=ids).loss
    loss.backward()
    if variant == "gated":  # σ'(0) = 1/4: every gate has gradient at the exact-Llama start
        assert all(p.grad.abs().sum().item() > 0 for name, p in converted.named_parameters() if ".value_gate." in name)
        return
    offsets = dict(converted.model.value_residual.named_parameters())
    moving = offsets["lambda_first_offset"] if variant == "learnable" else offsets["lambda_scale_offset"]
    assert moving.requires_grad and moving.grad.abs().sum().item() > 0
    assert offsets["lambda_self_offset"].grad.abs().sum().item() > 0


@pytest.mark.parametrize(("kind", "variant", "layout"), [("llama-bf16", "learnable", "alternating"),
                                                       ("llama-sharded", "learnable_plus", [0, 2])])
def test_value_embeddings_are_added_as_zeros_in_the_weights_dtype_and_keep_the_outputs(sources, tmp_path, kind,
                                                                                        variant, layout):
    """Issue 56: `value_embeddings=` (`--value-embeddings`) writes every table and gate as zeros, in the source's
    dtype (bf16 stays bf16, a table is vocabulary-sized), so the converted model computes the source's logits exactly
    (verified) and its tables get gradient at the first step."""
    dst = tmp_path / "converted"
    report = convert_llama_checkpoint(sources[kind], dst, variant=variant, value_embeddings=layout, verify=True,
                                      progress=False)
    assert report.max_abs_logit_diff == 0.0
    assert json.loads((dst / "config.json").read_text())["value_embeddings"] == layout
    ids = probe_ids(SMALL["vocab_size"])
    assert torch.equal(logits_of(dst, ids), logits_of(sources[kind], ids))
    converted = AutoModelForCausalLM.from_pretrained(dst, dtype="auto")
    layers = converted.config.value_embedding_layers
    tables = {n: p for n, p in converted.named_parameters() if ".self_attn.value_embedding" in n}
    assert set(tables) <= set(report.added_tensors) and len(tables) == 2 * len(layers)
    source_dtype = converted.model.embed_tokens.weight.dtype
    assert all(p.dtype == source_dtype and not p.any() for p in tables.values())
    converted.float().train()
    converted(input_ids=ids, labels=ids).loss.backward()
    assert all(tables[f"model.layers.{n}.self_attn.value_embedding.weight"].grad.abs().sum() > 0 for n in layers)


def test_the_value_embeddings_flag_takes_a_layout_or_layer_indices(sources, tmp_path):
    from resformer_hf.cli.convert import build_parser

    parse = build_parser().parse_args
    assert parse(["a", "b", "--value-embeddings", "u_net"]).value_embeddings == "u_net"
    assert parse(["a", "b", "--value-embeddings", "1,3"]).value_embeddings == [1, 3]
    with pytest.raises(ConversionError, match="value_embeddings='unet' is not a layout"):
        convert_llama_checkpoint(sources["llama-tied"], tmp_path / "x", value_embeddings="unet", progress=False)


def _stored_tensors(directory: Path) -> dict[str, str]:
    """Tensor name -> file, read from the safetensors headers (and checked against the index when sharded)."""
    stored = {}
    for path in sorted(directory.glob("*.safetensors")):
        with safe_open(str(path), "pt") as handle:
            assert handle.metadata() == {"format": "pt"}
            stored.update(dict.fromkeys(handle.keys(), path.name))
    index = directory / "model.safetensors.index.json"
    if index.exists():
        data = json.loads(index.read_text())
        assert data["weight_map"] == stored
        sizes = 0
        for path in directory.glob("*.safetensors"):
            with safe_open(str(path), "pt") as handle:
                sizes += sum(handle.get_tensor(k).nbytes for k in handle.keys())
        assert data["metadata"]["total_size"] == sizes
    return stored


def test_sharded_output_keeps_layout_and_copies_side_files(sources, tmp_path):
    src = shutil.copytree(sources["llama-sharded"], tmp_path / "src")
    (src / "tokenizer_config.json").write_text(json.dumps({"model_max_length": 64}))
    dst = tmp_path / "out"
    report = convert_llama_checkpoint(src, dst, progress=False)
    source_index = json.loads((src / "model.safetensors.index.json").read_text())
    shard_names = sorted(set(source_index["weight_map"].values()))
    assert len(shard_names) > 2 and report.num_shards == len(shard_names)
    assert sorted(p.name for p in dst.glob("*.safetensors")) == shard_names
    assert not list(dst.glob("*.bin")) and not list(tmp_path.glob(".out.partial-*"))
    assert (dst / "tokenizer_config.json").read_bytes() == (src / "tokenizer_config.json").read_bytes()
    card = (dst / "README.md").read_text()
    assert "learnable" in card and "preserve" in card and str(src) in card
    config = json.loads((dst / "config.json").read_text())
    assert config["model_type"] == "resformer" and config["architectures"] == ["ResFormerForCausalLM"]
    assert config["value_residual_lambda_first"] == 0.0 and config["value_residual_lambda_self"] == 1.0


def test_converted_folder_says_how_the_model_samples(sources, tmp_path):
    """A source generation_config that leaves do_sample unset gets OpenAI's defaults (temperature 1, no top-k or
    nucleus), its other fields kept; one that says how the source samples (Llama 3's) is copied byte for byte; a
    source without one gets one, with the model's token ids."""
    unset = shutil.copytree(sources["llama-tied"], tmp_path / "unset")
    before = json.loads((unset / "generation_config.json").read_text())
    assert "do_sample" not in before
    convert_llama_checkpoint(unset, tmp_path / "unset-out", progress=False, verify=False)
    after = json.loads((tmp_path / "unset-out" / "generation_config.json").read_text())
    assert {key: after.get(key) for key in SAMPLING_DEFAULTS} == SAMPLING_DEFAULTS
    assert {key: after[key] for key in before if key != "_from_model_config"} == {
        key: value for key, value in before.items() if key != "_from_model_config"}
    sampling = shutil.copytree(sources["llama-tied"], tmp_path / "sampling")
    (sampling / "generation_config.json").write_text(json.dumps(
        {"bos_token_id": 1, "eos_token_id": 2, "do_sample": True, "temperature": 0.6, "top_p": 0.9}))
    convert_llama_checkpoint(sampling, tmp_path / "sampling-out", progress=False, verify=False)
    assert (tmp_path / "sampling-out" / "generation_config.json").read_bytes() == (
        sampling / "generation_config.json").read_bytes()
    (sampling / "generation_config.json").unlink()
    convert_llama_checkpoint(sampling, tmp_path / "none-out", progress=False, verify=False)
    written = json.loads((tmp_path / "none-out" / "generation_config.json").read_text())
    assert {key: written.get(key) for key in SAMPLING_DEFAULTS} == SAMPLING_DEFAULTS
    assert written["eos_token_id"] == json.loads((sampling / "config.json").read_text())["eos_token_id"]


def test_sentencepiece_tokenizer_checkpoint(tmp_path):
    """A checkpoint with a Llama-2-layout SentencePiece `tokenizer.model` (unk/bos/eos = 0/1/2, byte fallback),
    trained here on the bundled English sample: the tokenizer is copied byte for byte and the logits are preserved on
    real text."""
    import sentencepiece

    text = sample_text(60_000)
    model_file = tmp_path / "sp"
    sentencepiece.SentencePieceTrainer.train(
        sentence_iterator=iter(text.splitlines()), model_prefix=str(model_file), vocab_size=600, model_type="bpe",
        byte_fallback=True, unk_id=0, bos_id=1, eos_id=2, pad_id=-1, minloglevel=2,
    )
    src = tmp_path / "src"
    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(**{**SMALL, "vocab_size": 600})).save_pretrained(src)
    shutil.copyfile(f"{model_file}.model", src / "tokenizer.model")
    dst = tmp_path / "dst"
    convert_llama_checkpoint(src, dst, variant="learnable_plus", progress=False)
    assert (dst / "tokenizer.model").read_bytes() == (src / "tokenizer.model").read_bytes()
    tokens = sentencepiece.SentencePieceProcessor(model_file=str(dst / "tokenizer.model")).encode(text[:400])[:24]
    ids = torch.tensor([tokens, tokens[::-1]])
    assert (logits_of(dst, ids) - logits_of(src, ids)).abs().max().item() <= 1e-5


def test_dtype_option_casts_and_records(sources, tmp_path):
    dst = tmp_path / "bf16"
    report = convert_llama_checkpoint(sources["llama-tied"], dst, dtype="bfloat16", verify=True, progress=False)
    assert report.dtype == "bfloat16" and report.max_abs_logit_diff == 0.0
    with safe_open(str(dst / "model.safetensors"), "pt") as handle:
        dtypes = {name: handle.get_slice(name).get_dtype() for name in handle.keys()}
    lambdas = {dtypes.pop(name) for name in list(dtypes) if name.startswith("model.value_residual.")}
    assert lambdas == {"F32"}  # λ stay float32 (_keep_in_fp32_modules_strict)
    assert set(dtypes.values()) == {"BF16"}
    assert json.loads((dst / "config.json").read_text())["dtype"] == "bfloat16"


# ---- conversions that change outputs -----------------------------------------------------------------------------


def test_svformer_drops_v_proj_and_measures_divergence(sources, tmp_path):
    src = sources["llama-sharded"]
    with pytest.raises(ConversionError, match="init='paper'"):
        convert_llama_checkpoint(src, tmp_path / "refused", variant="svformer", progress=False)
    assert not (tmp_path / "refused").exists()

    dst = tmp_path / "sv"
    report = convert_llama_checkpoint(src, dst, variant="svformer", init="paper", progress=False)
    stored = _stored_tensors(dst)
    assert "model.layers.0.self_attn.v_proj.weight" in stored
    assert not any(f"layers.{i}.self_attn.v_proj" in name for name in stored for i in (1, 2))
    assert sorted(report.dropped_tensors) == [f"model.layers.{i}.self_attn.v_proj.weight" for i in (1, 2)]
    model = AutoModelForCausalLM.from_pretrained(dst)
    assert model.model.layers[1].self_attn.v_proj is None
    # The reported divergence is the one measured independently on the converter's probe batch.
    from resformer_hf.conversion import probe_input_ids

    ids = probe_input_ids(SMALL["vocab_size"])
    with torch.no_grad():
        source = AutoModelForCausalLM.from_pretrained(src)(input_ids=ids).logits
        divergence = (model(input_ids=ids).logits - source).abs().max().item()
    assert divergence > 1e-3
    assert report.max_abs_logit_diff == pytest.approx(divergence, rel=1e-5)
    assert any("needs uptraining" in note and f"{divergence:.3g}" in note for note in report.notes)


@pytest.mark.parametrize("variant, expected", [("learnable", (0.5, 0.5)), ("constant", (2.0, 1.0)),
                                               ("gated", (0.5, 0.5))])
def test_paper_init_uses_paper_values_and_says_outputs_change(sources, tmp_path, variant, expected):
    dst = tmp_path / variant
    report = convert_llama_checkpoint(sources["llama-tied"], dst, variant=variant, init="paper", progress=False)
    model = AutoModelForCausalLM.from_pretrained(dst)
    assert torch.equal(model.value_residual_lambdas()[1:], torch.tensor([expected] * 2))
    assert report.max_abs_logit_diff is not None and report.max_abs_logit_diff > 1e-4
    assert any("outputs differ" in note for note in report.notes)


@pytest.mark.parametrize("variant", ["identity", "constant", "sparse"])
def test_fixed_variants_refuse_preserve(sources, tmp_path, variant):
    with pytest.raises(ConversionError, match="cannot preserve"):
        convert_llama_checkpoint(sources["llama-tied"], tmp_path / "x", variant=variant, progress=False)


# ---- bad inputs: one-line errors, exit code 2, SRC untouched, no DST ---------------------------------------------


def _corrupt(kind: str, src: Path, tmp_path: Path) -> tuple[list[str], str]:
    """Prepare a bad input; returns (extra CLI args, words the error must contain)."""
    if kind == "no-config":
        (src / "config.json").unlink()
        return [], "no config.json"
    if kind == "model-type":
        config = json.loads((src / "config.json").read_text())
        config.update(model_type="gpt2", architectures=["GPT2LMHeadModel"])
        (src / "config.json").write_text(json.dumps(config))
        return [], "model_type 'gpt2' is not supported"
    if kind == "unmodelled-field":  # a field of a config ResFormer does not compute is refused by name
        config = json.loads((src / "config.json").read_text())
        (src / "config.json").write_text(json.dumps({**config, "attention_chunk_size": 16}))
        return [], "config.json holds attention_chunk_size, which ResFormer does not model"
    if kind == "rope":
        config = json.loads((src / "config.json").read_text())
        config["rope_parameters"] = {"rope_type": "mrope", "rope_theta": 10000.0}
        (src / "config.json").write_text(json.dumps(config))
        return [], "rope"
    if kind == "truncated":
        shard = sorted(src.glob("model-*.safetensors"))[1]
        shard.write_bytes(shard.read_bytes()[:-100])
        return [], "truncated or corrupted"
    if kind == "bad-header":
        shard = sorted(src.glob("model-*.safetensors"))[0]
        data = shard.read_bytes()
        shard.write_bytes(data[:8] + b"{not json" + data[17:])
        return [], "truncated or corrupted"
    if kind == "missing-shard":
        sorted(src.glob("model-*.safetensors"))[-1].unlink()
        return [], "missing"
    if kind == "shape-mismatch":
        config = json.loads((src / "config.json").read_text())
        (src / "config.json").write_text(json.dumps({**config, "intermediate_size": 48}))
        return [], "shape"
    if kind == "pickle":
        for path in src.glob("model*"):
            path.unlink()
        torch.save(LlamaForCausalLM(LlamaConfig(**SMALL)).state_dict(), src / "pytorch_model.bin")
        return [], "--allow-pickle"
    if kind == "dst-inside-src":
        return ["--dst", str(src / "converted")], "inside SRC"
    if kind == "dst-not-empty":
        (tmp_path / "dst").mkdir()
        (tmp_path / "dst" / "keep.txt").write_text("mine")
        return [], "--overwrite"
    raise ValueError(kind)


BAD_INPUTS = ["no-config", "model-type", "unmodelled-field", "rope", "truncated", "bad-header", "missing-shard",
              "shape-mismatch", "pickle", "dst-inside-src", "dst-not-empty"]


@pytest.mark.parametrize("kind", BAD_INPUTS)
def test_bad_input_gives_one_line_error(sources, tmp_path, capsys, kind):
    src = tmp_path / "src"
    shutil.copytree(sources["llama-sharded"], src)
    extra, words = _corrupt(kind, src, tmp_path)
    dst = Path(extra[1]) if extra else tmp_path / "dst"
    before = tree_hash(src)
    dst_before = tree_hash(dst) if dst.exists() else None
    code = cli_main([str(src), str(dst), "--no-progress"])
    err = capsys.readouterr().err.strip()
    assert code == 2
    assert err.startswith("resformer-convert: error:") and "\n" not in err and "Traceback" not in err
    assert words in err
    assert tree_hash(src) == before
    assert (tree_hash(dst) if dst.exists() else None) == dst_before
    assert not list(tmp_path.glob(".dst.partial-*")) and not list(src.glob(".converted.partial-*"))


def test_allow_pickle_converts_bin_to_safetensors(tmp_path):
    """An old-style checkpoint: pytorch_model.bin holding the full state dict (tied lm_head.weight included)."""
    src = tmp_path / "src"
    torch.manual_seed(0)
    source = LlamaForCausalLM(LlamaConfig(**SMALL, tie_word_embeddings=True)).eval()
    source.config.save_pretrained(src)
    torch.save(source.state_dict(), src / "pytorch_model.bin")
    dst = tmp_path / "dst"
    assert cli_main([str(src), str(dst), "--allow-pickle", "--no-progress"]) == 0
    assert not list(dst.glob("*.bin")) and (dst / "model.safetensors").exists()
    assert "lm_head.weight" not in _stored_tensors(dst)  # tied: rebuilt from the embeddings on load
    ids = probe_ids(SMALL["vocab_size"])
    with torch.no_grad():
        mask = torch.ones_like(ids)
        mask[1, :3] = 0
        expected = source(input_ids=ids, attention_mask=mask).logits
    assert (logits_of(dst, ids) - expected).abs().max().item() <= 1e-5


def test_overwrite_replaces_only_when_complete(sources, tmp_path):
    dst = tmp_path / "dst"
    dst.mkdir()
    (dst / "old.txt").write_text("old")
    assert cli_main([str(sources["llama-tied"]), str(dst), "--overwrite", "--no-progress"]) == 0
    assert not (dst / "old.txt").exists() and (dst / "model.safetensors").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["dst"]  # no staging or retired copies left behind


def test_offline_hub_id_is_a_clear_error(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ConversionError, match="could not be fetched from the Hub"):
        convert_llama_checkpoint("nobody-here/no-such-model", tmp_path / "dst", progress=False)


# ---- real processes: the installed command, and killing a conversion mid-run -----------------------------------


def _env() -> dict[str, str]:
    return {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "PYTHONPATH": str(REPO)}


def test_cli_process_reports_error_on_one_line(tmp_path):
    """The wrapper script in conversion/ runs the same CLI: a real process exits non-zero with one line."""
    script = REPO / "conversion" / "convert_llama_to_resformer.py"
    (tmp_path / "src").mkdir()
    result = subprocess.run([sys.executable, str(script), str(tmp_path / "src"), str(tmp_path / "dst")],
                            capture_output=True, text=True, env=_env(), timeout=120)
    assert result.returncode == 2
    assert result.stderr.strip().count("\n") == 0 and "no config.json" in result.stderr
    assert not (tmp_path / "dst").exists()


_LOAD_WITHOUT_PLUGIN = """
import sys, torch
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM
model = AutoModelForCausalLM.from_pretrained(sys.argv[1], trust_remote_code=True).eval()
assert "resformer_hf" not in sys.modules, "the plugin must not be needed"
ids = torch.randint(0, model.config.vocab_size, (2, 12), generator=torch.Generator().manual_seed(1))
with torch.no_grad():
    save_file({"logits": model(input_ids=ids).logits.contiguous()}, sys.argv[2])
"""


def test_converted_checkpoint_loads_with_remote_code_only(sources, tmp_path):
    """The output carries the modeling files and auto_map (as save_pretrained writes them): a process that never
    imports resformer_hf loads it with trust_remote_code=True and computes the source's logits."""
    src = sources["qwen2"]
    dst = tmp_path / "dst"
    convert_llama_checkpoint(src, dst, variant="learnable_plus", progress=False)
    assert json.loads((dst / "config.json").read_text())["auto_map"] == full_auto_map()
    env = {**_env(), "PYTHONPATH": ""}
    result = subprocess.run([sys.executable, "-c", _LOAD_WITHOUT_PLUGIN, str(dst), str(tmp_path / "logits.st")],
                            capture_output=True, text=True, env=env, timeout=120, cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-2000:]
    from safetensors.torch import load_file

    remote = load_file(tmp_path / "logits.st")["logits"]
    ids = probe_ids(SMALL["vocab_size"])
    with torch.no_grad():
        expected = AutoModelForCausalLM.from_pretrained(src)(input_ids=ids).logits
    assert (remote - expected).abs().max().item() <= 1e-5
