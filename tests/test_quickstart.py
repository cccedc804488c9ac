"""`resformer-quickstart` end to end on tiny settings: convert, Trainer fine-tune, generate, Hub-ready folder, upload
(intercepted at `HfApi`), and one-line errors with a non-zero exit for bad input."""

from __future__ import annotations

import configparser
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from bases import BASES, save_source
from huggingface_hub import HfApi, ModelCard, RepoUrl
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM

from resformer_hf import quickstart
from resformer_hf.cli.quickstart import main as quickstart_main
from resformer_hf.text import sample_text, train_tokenizer

REPO_ROOT = Path(__file__).resolve().parents[1]
TINY_RUN = ["--batch-size", "4", "--block-size", "32", "--max-new-tokens", "5", "--vocab-size", "300"]


def _card_value(card: ModelCard, fact: str) -> str:
    match = re.search(rf"^\| {re.escape(fact)} \| (.+) \|$", card.content, re.MULTILINE)
    assert match, f"{fact!r} missing from the card"
    return match.group(1)


@pytest.fixture(scope="module")
def text_file(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("data") / "austen.txt"
    path.write_text(sample_text(60_000), encoding="utf-8")
    return path


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory, text_file) -> Path:
    """A tiny Llama checkpoint with its own tokenizer, as a user's `--model` would be."""
    directory = tmp_path_factory.mktemp("llama")
    tokenizer = train_tokenizer([text_file.read_text(encoding="utf-8")], 300)
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=3,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                         bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                         pad_token_id=tokenizer.pad_token_id)
    LlamaForCausalLM(config).save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory


@pytest.mark.slow
def test_converts_a_given_model_fine_tunes_and_writes_a_loadable_folder(tmp_path, tiny_llama, text_file, capsys):
    out = tmp_path / "out"
    code = quickstart_main(["--model", str(tiny_llama), "--data", str(text_file), "--steps", "30",
                            "--learning-rate", "5e-3", "--output", str(out), *TINY_RUN])
    printed = capsys.readouterr().out
    assert code == 0, printed
    assert "max |Δ logits| converted vs source: 0 (exact" in printed  # init=preserve by default for --model
    written = {p.name for p in out.iterdir()}
    assert {"config.json", "model.safetensors", "generation_config.json", "tokenizer.json", "README.md",
            "modeling_resformer.py", "configuration_resformer.py", "value_residual.py"} <= written

    config = json.loads((out / "config.json").read_text())
    assert config["model_type"] == "resformer" and config["value_residual"] == "learnable_plus"
    sampling = json.loads((out / "generation_config.json").read_text())
    assert {key: sampling[key] for key in quickstart.SAMPLING} == quickstart.SAMPLING  # as its sample was drawn
    assert config["use_cache"] is True  # publishable: the Trainer's training-time setting is not kept
    card = ModelCard.load(out / "README.md")
    assert card.data.pipeline_tag == "text-generation" and "license" not in card.data.to_dict()
    before, after = map(float, _card_value(card, "held-out loss before → after").split(" → "))
    assert after < before - 0.1, (before, after)  # 30 steps on real text must help a random tiny model
    assert _card_value(card, "steps") == "30"

    # The folder is what the card says: the trained model (not the source) with the λ it lists, and its tokenizer.
    model = AutoModelForCausalLM.from_pretrained(out)
    source = LlamaForCausalLM.from_pretrained(tiny_llama)
    tokenizer = AutoTokenizer.from_pretrained(out)
    ids = tokenizer("It is a truth universally acknowledged", return_tensors="pt")["input_ids"]
    assert tokenizer.decode(ids[0]) == "It is a truth universally acknowledged"
    with torch.no_grad():
        assert (model(ids).logits - source(ids).logits).abs().max() > 1e-3
    rows = re.findall(r"^\| \d+ \| (?:yes|no) \| (-?[\d.]+) \| (-?[\d.]+) \|$", card.content, re.MULTILINE)
    assert torch.allclose(torch.tensor([[float(a), float(b)] for a, b in rows]), model.value_residual_lambdas(),
                          atol=5e-5)


@pytest.mark.slow
def test_converts_a_gemma_3_keeping_its_architecture(tmp_path, text_file, capsys):
    """Issue 67: `--model` takes every base the converter does; Gemma 3 differs from Llama the most (sandwich norms,
    `1 + w` norms, q/k norms, scaled embeddings, window layers): converted exactly, trained, and its card says so."""
    source = save_source("gemma3", tmp_path / "gemma3")
    out = tmp_path / "out"
    code = quickstart_main(["--model", str(source), "--data", str(text_file), "--steps", "10", "--learning-rate",
                            "5e-3", "--output", str(out), *TINY_RUN])
    printed = capsys.readouterr().out
    assert code == 0, printed
    assert "max |Δ logits| converted vs source: 0 (exact" in printed
    config = json.loads((out / "config.json").read_text())
    assert {fact: config[fact] for fact in BASES["gemma3"][2]} == BASES["gemma3"][2]
    card = ModelCard.load(out / "README.md")
    before, after = map(float, _card_value(card, "held-out loss before → after").split(" → "))
    assert after < before - 0.1, (before, after)
    assert "2 of 4 layers attending over a 6-token window" in " ".join(card.content.split())


@pytest.mark.slow
def test_defaults_build_a_llama_on_the_bundled_text_and_push(tmp_path, monkeypatch, capsys):
    commits = []

    def create_repo(api, repo_id, **kwargs):
        return RepoUrl(f"https://huggingface.co/{repo_id}")

    def create_commit(api, repo_id, operations, **kwargs):
        commits.append((repo_id, {op.path_in_repo: Path(op.path_or_fileobj).read_bytes() for op in operations}))
        return f"https://huggingface.co/{repo_id}/commit/fake"

    monkeypatch.setattr(HfApi, "create_repo", create_repo)
    monkeypatch.setattr(HfApi, "create_commit", create_commit)
    out = tmp_path / "out"
    code = quickstart_main(["--steps", "2", "--output", str(out), "--push-to-hub", "someone/demo", *TINY_RUN])
    printed = capsys.readouterr().out
    assert code == 0, printed
    assert quickstart.SAMPLE_DESCRIPTION in printed and "init=paper" in printed
    (repo_id, files), = commits
    assert repo_id == "someone/demo"
    assert set(files) == {p.name for p in out.iterdir()}
    card = ModelCard(files["README.md"].decode("utf-8"))
    assert card.data.license == "apache-2.0" and card.data.model_name == "demo"
    assert 'from_pretrained("someone/demo", trust_remote_code=True)' in card.content
    assert json.loads(files["config.json"])["hidden_size"] == quickstart.SMALL_LLAMA["hidden_size"]
    assert len(AutoTokenizer.from_pretrained(out)) == 300


@pytest.mark.slow
def test_trains_on_a_datasets_folder(tmp_path, tiny_llama, text_file, capsys):
    folder = tmp_path / "corpus"
    folder.mkdir()
    (folder / "part.txt").write_text(text_file.read_text(encoding="utf-8")[:20_000], encoding="utf-8")
    out = tmp_path / "out"
    code = quickstart_main(["--model", str(tiny_llama), "--dataset", str(folder), "--steps", "2",
                            "--output", str(out), *TINY_RUN])
    assert code == 0, capsys.readouterr()
    card = ModelCard.load(out / "README.md")
    assert _card_value(card, "data") == f"dataset {folder}"
    assert "datasets" not in card.data.to_dict()  # a local folder is not a Hub dataset id
    assert quickstart_main(["--model", str(tiny_llama), "--dataset", str(folder), "--text-column", "body",
                            "--output", str(tmp_path / "out2"), *TINY_RUN]) == 2
    assert "has no column 'body'; its columns are text" in capsys.readouterr().err


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--model", "/no/such/checkpoint"], "--model /no/such/checkpoint is not a local directory"),
        (["--model", "nobody/not-a-real-model-xyz"], "could not be fetched from the Hub"),
        (["--data", "/no/such/file.txt"], "--data file /no/such/file.txt does not exist"),
        (["--dataset", "nobody/not-a-real-dataset-xyz"], "cannot load dataset 'nobody/not-a-real-dataset-xyz'"),
    ],
)
def test_bad_input_is_one_line_and_exit_2(tmp_path, capsys, argv, message):
    code = quickstart_main([*argv, "--output", str(tmp_path / "out"), "--steps", "1", *TINY_RUN])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2
    assert len(err) == 1 and err[0].startswith("resformer-quickstart: error: ") and message in err[0], err


def test_block_longer_than_the_models_positions_is_refused(tmp_path, tiny_llama, text_file, capsys):
    code = quickstart_main(["--model", str(tiny_llama), "--data", str(text_file), "--block-size", "128",
                            "--output", str(tmp_path / "out")])
    assert code == 2
    assert "--block-size 128 exceeds the model's max_position_embeddings (64)" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_refuses_to_clobber_a_non_empty_output(tmp_path, capsys):
    (tmp_path / "keep.txt").write_text("user data")
    assert quickstart_main(["--output", str(tmp_path)]) == 2
    assert "pass --overwrite" in capsys.readouterr().err
    assert (tmp_path / "keep.txt").read_text() == "user data"


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--steps", "0"], "--steps: 0 must be positive"),
        (["--learning-rate", "nan"], "--learning-rate: nan must be a positive number"),
    ],
)
def test_bad_flags_are_one_line_and_exit_2(capsys, argv, message):
    with pytest.raises(SystemExit) as exit_info:
        quickstart_main(argv)
    err = capsys.readouterr().err.strip().splitlines()
    assert exit_info.value.code == 2
    assert len(err) == 1 and err[0].startswith("resformer-quickstart: error: ") and message in err[0], err


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--variant", "svformer", "--init", "preserve"], "--init preserve cannot preserve"),
        (["--dataset-config", "x"], "--dataset-config needs --dataset"),
    ],
)
def test_inconsistent_settings_are_one_line_and_exit_2(tmp_path, capsys, argv, message):
    """Checked by `QuickstartSettings` itself, so library callers get the same message as the command."""
    assert quickstart_main([*argv, "--output", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("resformer-quickstart: error: ") and message in err[0], err
    with pytest.raises(quickstart.QuickstartError, match=message.split()[0]):
        quickstart.QuickstartSettings(**({"variant": "svformer", "init": "preserve"} if "--init" in argv
                                         else {"dataset_config": "x"}))


@pytest.mark.slow
def test_bad_flags_exit_2_without_traceback_in_a_real_process():
    for argv in (["--steps", "0"], ["--no-such-flag"]):
        result = subprocess.run([sys.executable, "-m", "resformer_hf.cli.quickstart", *argv], capture_output=True,
                                text=True, timeout=120)
        assert result.returncode == 2, result
        assert result.stdout == "" and len(result.stderr.strip().splitlines()) == 1, result.stderr
        assert "Traceback" not in result.stderr


def test_console_script_is_declared():
    setup = configparser.ConfigParser()
    setup.read(REPO_ROOT / "setup.cfg")
    scripts = setup["options.entry_points"]["console_scripts"]
    assert "resformer-quickstart = resformer_hf.cli.quickstart:main" in scripts
    assert "data/*.txt" in setup["options.package_data"]["resformer_hf"]


def test_the_readme_names_what_quickstart_converts_a_model_to():
    """`--model` converts to the `--variant` default with `--init preserve` (issue 68: the README did not say which
    variant); the README names both, and the converter's default it recommends instead."""
    from resformer_hf.cli.quickstart import build_parser
    from resformer_hf.conversion import DEFAULT_CONVERSION_VARIANT

    variant = build_parser().parse_args(["--model", "m"]).variant
    readme = " ".join((REPO_ROOT / "README.md").read_text(encoding="utf-8").split())
    assert (f"`--model DIR_OR_ID` converts your checkpoint instead (a Llama, Mistral, Qwen 2 or 3, SmolLM3, OLMo 2 "
            f"or 3, or Gemma 3's text model), to `{variant}` (the default "
            "`--variant`) with `--init preserve` by default") in readme
    assert f"`--variant {DEFAULT_CONVERSION_VARIANT}`, the converter's default" in readme


def test_the_quickstarts_default_output_is_ignored_by_git():
    """Run in the clone, as the README says, the quickstart writes `./resformer-quickstart`: git must not offer it."""
    from resformer_hf.cli.quickstart import build_parser

    output = build_parser().parse_args([]).output
    ignored = subprocess.run(["git", "check-ignore", "-q", f"{output}/model.safetensors"], cwd=REPO_ROOT,
                             capture_output=True)
    if ignored.returncode == 128:  # not a git checkout (an unpacked sdist)
        pytest.skip(f"{REPO_ROOT} is not a git checkout")
    assert ignored.returncode == 0, f"{output}/ is not in .gitignore"
