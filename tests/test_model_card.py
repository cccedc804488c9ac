"""Model cards: Hub metadata, the λ table against the model's own λ, round trip through README.md, and the template
shipping with a non-editable install."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import torch
from bases import SCRATCH, SIZE
from huggingface_hub import ModelCard

from resformer_hf import ResFormerConfig, ResFormerForCausalLM
from resformer_hf.hub.model_card import TEMPLATE_NAME, build_model_card, write_model_card

from helpers import tiny_config

REPO_ROOT = Path(__file__).resolve().parents[1]
ROW = re.compile(r"^\| (\d+) \| (yes|no) \| (-?[\d.]+) \| (-?[\d.]+) \|$", re.MULTILINE)


def _table(card: ModelCard) -> torch.Tensor:
    """The λ table as printed, parsed back to numbers: [L, 2] plus the 'uses V_0' column."""
    rows = ROW.findall(card.content)
    return torch.tensor([[float(first), float(own)] for _, _, first, own in rows]), [r[1] == "yes" for r in rows]


def test_metadata_for_a_converted_fine_tuned_model():
    card = build_model_card(
        tiny_config("learnable"),
        base_model="meta-llama/Llama-3.2-1B",
        init="preserve",
        datasets=["wikitext", "my local notes"],
        training={"steps": 30, "final train loss": 2.3456789},
        license="apache-2.0",
        model_id="someone/tiny-resformer",
    )
    data = card.data.to_dict()
    assert data["library_name"] == "transformers"
    assert data["pipeline_tag"] == "text-generation"
    assert {"resformer", "value-residual"} <= set(data["tags"])
    assert data["license"] == "apache-2.0"
    assert data["base_model"] == "meta-llama/Llama-3.2-1B"
    assert data["datasets"] == ["wikitext"]  # free text is shown in the body, never claimed as a Hub dataset
    text = card.content
    assert "my local notes" in text
    assert "| final train loss | 2.346 |" in text
    assert 'from_pretrained("someone/tiny-resformer", trust_remote_code=True)' in text
    assert "import resformer_hf" in text
    assert '`init="preserve"`' in text
    assert "@inproceedings{zhou2025value" in text and "2410.17897" in text


def test_unknown_facts_stay_out_of_the_metadata():
    card = build_model_card(tiny_config("constant"))
    data = card.data.to_dict()
    assert "license" not in data and "base_model" not in data and "datasets" not in data
    assert "## Training" not in card.content
    assert "fixed by the variant" in card.content


def test_lambda_table_shows_the_learned_values_of_the_model():
    model = ResFormerForCausalLM(tiny_config("learnable_plus"))
    with torch.no_grad():  # move λ away from their init, as training would
        for parameter in model.model.value_residual.parameters():
            parameter.copy_(torch.randn_like(parameter) * 0.3)
    expected = model.value_residual_lambdas()
    card = build_model_card(model.config, lambdas=expected)
    printed, receives = _table(card)
    assert printed.shape == (4, 2)
    assert torch.allclose(printed, expected, atol=5e-5)
    assert receives == [False, True, True, True]
    assert "learned ones stored in this checkpoint" in card.content


def test_lambda_table_defaults_to_the_documented_initial_values():
    # learnable_plus: λ_scale starts at L = 4, softmax of zero logits over the 3 receivers -> λ_first = 4/3.
    printed, _ = _table(build_model_card(tiny_config("learnable_plus")))
    expected = torch.tensor([[0.0, 1.0], [4 / 3, 0.5], [4 / 3, 0.5], [4 / 3, 0.5]])
    assert torch.allclose(printed, expected, atol=5e-5)
    # sparse on 4 layers: the last ceil(3*4/8) = 2 layers get the fixed (5, 1).
    printed, receives = _table(build_model_card(tiny_config("sparse")))
    assert torch.allclose(printed, torch.tensor([[0.0, 1.0], [0.0, 1.0], [5.0, 1.0], [5.0, 1.0]]))
    assert receives == [False, False, True, True]


def test_a_gated_models_table_shows_its_gates_mix_and_says_how_to_read_it():
    """`gated` mixes per token: the card shows the mix of its gates' biases (`value_residual_lambdas()`), says so,
    and starts at g0 for every receiving layer (0.5, or 0 for a preserving conversion)."""
    printed, receives = _table(build_model_card(tiny_config("gated", value_residual_lambda_first=0.0)))
    assert torch.equal(printed, torch.tensor([[0.0, 1.0]] * 4)) and receives == [False, True, True, True]
    model = ResFormerForCausalLM(tiny_config("gated"))
    with torch.no_grad():
        model.model.layers[2].self_attn.value_gate.bias.copy_(torch.tensor([1.0, -0.5]))
    card = build_model_card(model.config, lambdas=model.value_residual_lambdas())
    printed, _ = _table(card)
    mix = (torch.sigmoid(torch.tensor(1.0)) + torch.sigmoid(torch.tensor(-0.5))).item() / 2
    assert torch.allclose(printed, torch.tensor([[0.0, 1.0], [0.5, 0.5], [mix, 1 - mix], [0.5, 0.5]]), atol=5e-5)
    assert "learned ones stored in this checkpoint" in card.content and "mixes per token and kv head" in card.content


def test_a_card_states_the_value_embedding_layers_and_the_parameters_they_add():
    """Issue 56: the layers with a table and the exact number of parameters the tables and gates add (counted on the
    model); a model without tables has no such row."""
    config = tiny_config("learnable_plus", value_embeddings="alternating")
    added = sum(p.numel() for name, p in ResFormerForCausalLM(config).named_parameters() if ".value_embedding" in name)
    content = build_model_card(config).content
    assert f"| value embeddings | layers 1, 3 add `g·E[token]` to their values (`alternating`): {added:,} parameters" \
        in content and added == 2 * (128 * 16 + 2 * 12)
    assert "| value embeddings |" not in build_model_card(tiny_config("learnable_plus")).content


@pytest.mark.parametrize("base, words", [
    ("llama3.2", "Llama's architecture, and the"),
    ("gemma3", "Llama's architecture with RMSNorm on each head's queries and keys, norms before and after each "
               "sublayer, norms that scale by `1 + w`, embeddings scaled by 8, attention scores scaled by 12^-1/2, "
               "2 of 4 layers attending over a 6-token window, and the"),
    ("olmo2", "with RMSNorm over the whole query and key projections, norms on each sublayer's output"),
    ("smollm3", "with no RoPE in layers 1, 3, and the"),
])
def test_a_card_says_which_base_architecture_the_model_has(base, words):
    """Issue 67: a converted Gemma 3 or OLMo 2 is not Llama's architecture, and its card says how it differs."""
    config = ResFormerConfig(value_residual="learnable_plus", **SIZE, **SCRATCH[base])
    assert words in " ".join(build_model_card(config).content.split())


def test_write_model_card_round_trips_through_readme(tmp_path):
    config = tiny_config("svformer")
    path = write_model_card(tmp_path / "out", config, license="mit", training={"steps": 5})
    assert path == tmp_path / "out" / "README.md"
    loaded = ModelCard.load(path)
    assert loaded.data.license == "mit"
    assert "svformer" in loaded.data.tags
    assert loaded.content == build_model_card(config, license="mit", training={"steps": 5}).content


def test_bad_arguments_say_what_to_pass():
    config = tiny_config()
    with pytest.raises(ValueError, match=r"shape \(3, 2\).*value_residual_lambdas"):
        build_model_card(config, lambdas=torch.zeros(3, 2))
    with pytest.raises(ValueError, match="NaN"):
        build_model_card(config, lambdas=torch.full((4, 2), float("nan")))
    with pytest.raises(TypeError, match="ResFormerConfig"):
        build_model_card({"value_residual": "learnable"})


def test_package_template_is_the_repository_template():
    assert (REPO_ROOT / "resformer_hf" / "hub" / TEMPLATE_NAME).read_bytes() == (
        REPO_ROOT / "model_cards" / "resformer.md"
    ).read_bytes(), "copy model_cards/resformer.md to resformer_hf/hub/model_card_template.md"


def test_installed_wheel_renders_cards(tmp_path):
    """Build a wheel from a copy of the sources, install it into a folder and render a card from there."""
    source = tmp_path / "src"
    source.mkdir()
    for name in ("setup.cfg", "pyproject.toml", "README.md", "LICENSE"):
        shutil.copy(REPO_ROOT / name, source / name)
    shutil.copytree(REPO_ROOT / "resformer_hf", source / "resformer_hf",
                    ignore=shutil.ignore_patterns("__pycache__"))
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check", "-q"]
    subprocess.run([*pip, "wheel", "--no-deps", "--no-build-isolation", "--no-index", "-w", str(tmp_path / "dist"),
                    str(source)], check=True, cwd=tmp_path)
    (wheel,) = (tmp_path / "dist").glob("*.whl")
    with zipfile.ZipFile(wheel) as archive:
        shipped = archive.read(f"resformer_hf/hub/{TEMPLATE_NAME}")
        assert shipped == (REPO_ROOT / "model_cards" / "resformer.md").read_bytes()
        # The quickstart's default training text ships too, with its credits.
        assert {"resformer_hf/data/sample_en.txt", "resformer_hf/data/README.md"} <= set(archive.namelist())
        archive.extractall(tmp_path / "site")
    script = (
        "import resformer_hf, pathlib; from resformer_hf.hub.model_card import build_model_card;"
        "print(pathlib.Path(resformer_hf.__file__).parent);"
        "print(build_model_card(resformer_hf.ResFormerConfig(num_hidden_layers=2, hidden_size=32,"
        " intermediate_size=64, num_attention_heads=2, vocab_size=64)).data.pipeline_tag)"
    )
    result = subprocess.run([sys.executable, "-c", script], cwd=tmp_path, capture_output=True, text=True,
                            env={"PYTHONPATH": str(tmp_path / "site"), "HF_HUB_OFFLINE": "1", "PATH": "/usr/bin:/bin"})
    assert result.returncode == 0, result.stderr
    location, tag = result.stdout.split()
    assert Path(location) == tmp_path / "site" / "resformer_hf"
    assert tag == "text-generation"


def test_the_cards_requirements_are_setup_cfgs():
    """The card says what `pip install` of the plugin requires (issue 68: it said torch>=2.6, which setup.cfg and the
    README rule out): each of setup.cfg's torch and transformers requirements, in the template and a rendered card."""
    import configparser

    setup = configparser.ConfigParser()
    setup.read(REPO_ROOT / "setup.cfg")
    required = {req.split(">")[0].split("<")[0]: req for req in setup["options"]["install_requires"].split()}
    sentence = f"Needs `{required['transformers']}` and `{required['torch']}`;"
    for text in ((REPO_ROOT / "model_cards" / "resformer.md").read_text(),
                 build_model_card(tiny_config("learnable_plus")).content):
        assert sentence in " ".join(text.split()), sentence
        assert not re.search(r"torch>=(?!" + re.escape(required["torch"].removeprefix("torch>=")) + r"`)", text)
