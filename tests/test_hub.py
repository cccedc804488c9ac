"""Hub publishing: self-contained remote code loaded by a fresh process that cannot import `resformer_hf`, and
`push_to_hub` exercised offline by intercepting `HfApi.create_repo` / `HfApi.create_commit`."""

from __future__ import annotations

import ast
import json
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import huggingface_hub.hf_api
import pytest
import torch
from huggingface_hub import HfApi, ModelCard, RepoUrl
from huggingface_hub.errors import EntryNotFoundError
from safetensors.torch import load_file, save_file
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

import resformer_hf
from resformer_hf import ResFormerForCausalLM, ResFormerForSequenceClassification
from resformer_hf import hub as resformer_hub
from resformer_hf.remote_code._compat import cache_of

from helpers import tiny_config

PACKAGE_DIR = Path(resformer_hf.__file__).parent
ALLOWED_TOP_LEVEL = set(sys.stdlib_module_names) | {"torch", "transformers", "huggingface_hub"}

# Runs in a fresh interpreter: `resformer_hf` is blocked at the import system, so only the copied files can be used.
FRESH_PROCESS = textwrap.dedent(
    """
    import importlib.abc, json, sys

    class BlockResformer(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path=None, target=None):
            if name.partition(".")[0] == "resformer_hf":
                raise ModuleNotFoundError(f"No module named {name!r} (blocked by the test)")

    sys.meta_path.insert(0, BlockResformer())
    import torch
    import transformers
    from safetensors.torch import load_file, save_file

    jobs = json.loads(sys.argv[1])
    torch.set_num_threads(jobs["threads"])
    report = {"errors": {}, "modules": {}}
    try:
        import resformer_hf  # noqa: F401
        report["plugin_importable"] = True
    except ModuleNotFoundError:
        report["plugin_importable"] = False
    for name, job in jobs["load"].items():
        auto_class = getattr(transformers, job["auto_class"])
        model = auto_class.from_pretrained(job["folder"], trust_remote_code=True).eval()
        report["modules"][name] = type(model).__module__
        input_ids = load_file(job["inputs"])["input_ids"]
        out = {}
        with torch.no_grad():
            out[job["field"]] = getattr(model(input_ids), job["field"])
        if job["generate"]:
            out["generated"] = model.generate(input_ids, max_new_tokens=6, do_sample=False)
        save_file(out, job["outputs"])
        if job.get("tokenizer_text"):
            tokenizer = transformers.AutoTokenizer.from_pretrained(job["folder"], trust_remote_code=True)
            report["token_ids"] = tokenizer(job["tokenizer_text"])["input_ids"]
    for name, job in jobs["refuse"].items():
        for trust in (None, False):
            try:
                transformers.AutoModelForCausalLM.from_pretrained(job["folder"], trust_remote_code=trust)
                report["errors"][f"{name}:{trust}"] = None
            except Exception as error:  # the test checks type and message
                report["errors"][f"{name}:{trust}"] = f"{type(error).__name__}: {error}"
    report["plugin_loaded"] = any(m.partition(".")[0] == "resformer_hf" for m in sys.modules)
    print()  # the trust prompt may have printed without a newline
    print("REPORT " + json.dumps(report))
    """
)


def _relative_imports(path: Path) -> set[str]:
    """File names of the `from .x import y` siblings of `path`, followed recursively (our own walk, not HF's)."""
    found: set[str] = set()
    pending = [path]
    while pending:
        tree = ast.parse(pending.pop().read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.level == 1 and node.module:
                name = f"{node.module}.py"
                if name not in found:
                    found.add(name)
                    pending.append(path.parent / name)
    return found


#: The remote code is exactly one folder of the package: every module in it, and nothing else, is what modeling
#: imports and what `save_pretrained` copies (so editing a file outside it never changes a published folder).
CODE_DIR = PACKAGE_DIR / "remote_code"
EXPECTED_CODE_FILES = {path.name for path in CODE_DIR.glob("*.py")} - {"__init__.py"}


def test_the_remote_code_folder_is_exactly_what_modeling_imports():
    assert {"modeling_resformer.py"} | _relative_imports(CODE_DIR / "modeling_resformer.py") == EXPECTED_CODE_FILES


def _perturb_lambdas(model) -> None:
    """Move every learnable λ off its initial value, so a reload that dropped them would show."""
    with torch.no_grad():
        depth = getattr(model.base_model, "depth_weighted_average", None)  # DenseFormer's depth weights too
        gates = [layer.self_attn.value_gate for layer in model.base_model.layers  # `gated`'s gates start at zero
                 if getattr(layer.self_attn, "value_gate", None) is not None]
        gates += [module for layer in model.base_model.layers if getattr(layer.self_attn, "has_value_embedding", 0)
                  for module in (layer.self_attn.value_embedding, layer.self_attn.value_embedding_gate)]  # at zero
        for parameter in [*model.base_model.value_residual.parameters(), *(depth.parameters() if depth else ()),
                          *(p for gate in gates for p in gate.parameters())]:
            parameter.add_(torch.randn_like(parameter) * 0.3)


def _tiny_tokenizer() -> PreTrainedTokenizerFast:
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{word: i + 3 for i, word in enumerate("the value of a layer".split())}}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>", bos_token="<s>", eos_token="</s>")


def test_save_pretrained_writes_self_contained_remote_code(tmp_path):
    model = ResFormerForCausalLM(tiny_config("svformer"))
    model.save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["auto_map"] == {
        "AutoConfig": "configuration_resformer.ResFormerConfig",
        "AutoModelForCausalLM": "modeling_resformer.ResFormerForCausalLM",
    }
    code_files = {path.name for path in tmp_path.glob("*.py")}
    assert code_files == EXPECTED_CODE_FILES
    assert {"configuration_resformer.py", "value_residual.py"} <= code_files
    for name in code_files:
        assert (tmp_path / name).read_bytes() == (CODE_DIR / name).read_bytes()
        tree = ast.parse((tmp_path / name).read_text())
        # Imports inside `try` are optional (transformers' check_imports skips them too, e.g. PEFT's defaults).
        optional = {id(node) for block in ast.walk(tree) if isinstance(block, ast.Try)
                    for statement in block.body for node in ast.walk(statement)}
        for node in ast.walk(tree):
            if id(node) in optional:
                continue
            if isinstance(node, ast.Import):
                tops = {alias.name.partition(".")[0] for alias in node.names}
            elif isinstance(node, ast.ImportFrom) and node.level == 0:
                tops = {node.module.partition(".")[0]}
            else:
                continue
            assert tops <= ALLOWED_TOP_LEVEL, f"{name} imports {tops - ALLOWED_TOP_LEVEL}"
    assert (tmp_path / "model.safetensors").exists() and (tmp_path / "generation_config.json").exists()
    assert not list(tmp_path.glob("*.bin"))


@pytest.mark.slow
def test_fresh_process_without_the_plugin_reproduces_outputs(tmp_path):
    torch.manual_seed(0)
    input_ids = torch.randint(3, 128, (2, 9))
    inputs = tmp_path / "inputs.safetensors"
    save_file({"input_ids": input_ids}, inputs)
    cases = {
        "learnable_plus": (ResFormerForCausalLM, tiny_config("learnable_plus"), "AutoModelForCausalLM"),
        "svformer": (ResFormerForCausalLM, tiny_config("svformer"), "AutoModelForCausalLM"),
        "neutreno": (ResFormerForCausalLM, tiny_config("neutreno"), "AutoModelForCausalLM"),
        "gated": (ResFormerForCausalLM, tiny_config("gated"), "AutoModelForCausalLM"),
        "value_embeddings": (ResFormerForCausalLM, tiny_config("learnable_plus", value_embeddings="alternating"),
                             "AutoModelForCausalLM"),
        "svformer_cla2": (ResFormerForCausalLM, tiny_config("svformer", cross_layer_attention=2),
                          "AutoModelForCausalLM"),
        "denseformer_cla2": (ResFormerForCausalLM, tiny_config("denseformer", cross_layer_attention=2,
                                                               denseformer_dilation=2), "AutoModelForCausalLM"),
        "dense_classifier": (
            ResFormerForSequenceClassification,
            tiny_config("dense", num_labels=3),
            "AutoModelForSequenceClassification",
        ),
    }
    jobs = {"threads": torch.get_num_threads(), "load": {}, "refuse": {}}
    expected = {}

    def add_job(name, auto_class, folder, field, outputs, generated=None):
        expected[name] = {field: outputs} | ({"generated": generated} if generated is not None else {})
        jobs["load"][name] = {
            "auto_class": auto_class,
            "folder": str(folder),
            "field": field,
            "inputs": str(inputs),
            "outputs": str(tmp_path / f"{name}.out.safetensors"),
            "generate": generated is not None,
        }

    for name, (model_class, config, auto_class) in cases.items():
        model = model_class(config).eval()
        _perturb_lambdas(model)
        model.save_pretrained(tmp_path / name)
        with torch.no_grad():
            logits = model(input_ids).logits
            generated = model.generate(input_ids, max_new_tokens=6, do_sample=False) if model.can_generate() else None
        add_job(name, auto_class, tmp_path / name, "logits", logits, generated)
        if name == "learnable_plus":
            # `save_for_hub` writes the full auto_map: the causal-LM folder also loads as the bare `AutoModel`.
            resformer_hub.save_for_hub(model, tmp_path / "hub_folder", tokenizer=_tiny_tokenizer())
            with torch.no_grad():
                hidden = model.model(input_ids).last_hidden_state
            add_job("hub_folder_as_automodel", "AutoModel", tmp_path / "hub_folder", "last_hidden_state", hidden)
            jobs["load"]["hub_folder_as_automodel"]["tokenizer_text"] = "the value of a layer"
    jobs["refuse"]["learnable_plus"] = {"folder": str(tmp_path / "learnable_plus")}

    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONSTARTUP")}
    env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", HF_MODULES_CACHE=str(tmp_path / "modules"))
    result = subprocess.run(
        [sys.executable, "-c", FRESH_PROCESS, json.dumps(jobs)],
        cwd=tmp_path, env=env, stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=240,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(result.stdout.rpartition("REPORT ")[2])
    assert report["plugin_importable"] is False and report["plugin_loaded"] is False
    assert report["modules"]["hub_folder_as_automodel"].endswith("modeling_resformer")
    assert report["token_ids"] == _tiny_tokenizer()("the value of a layer")["input_ids"] == [3, 4, 5, 6, 7]
    for name in expected:
        assert report["modules"][name].startswith("transformers_modules."), report["modules"][name]
        got = load_file(jobs["load"][name]["outputs"])
        for key, tensor in expected[name].items():
            assert torch.equal(got[key], tensor), f"{name}: {key} differs, max |Δ| {(got[key] - tensor).abs().max()}"
    for trust in ("None", "False"):
        error = report["errors"][f"learnable_plus:{trust}"]
        assert error is not None and error.startswith("ValueError: ")
        assert "contains custom code which must be executed" in error and "trust_remote_code=True" in error


class _FakeHub:
    """Stands in for the Hub at `HfApi.create_repo` / `HfApi.create_commit`; keeps what each commit uploaded."""

    def __init__(self, monkeypatch):
        self.repos: list[str] = []
        self.commits: list[dict[str, bytes]] = []
        hub = self

        def create_repo(api, repo_id, **kwargs):
            hub.repos.append(repo_id)
            return RepoUrl(f"https://huggingface.co/{repo_id}")

        def create_commit(api, repo_id, operations, **kwargs):
            files = {}
            for op in operations:
                source = op.path_or_fileobj
                files[op.path_in_repo] = Path(source).read_bytes() if isinstance(source, (str, Path)) else source
            hub.commits.append(files)
            return f"https://huggingface.co/{repo_id}/commit/fake"

        monkeypatch.setattr(HfApi, "create_repo", create_repo)
        monkeypatch.setattr(HfApi, "create_commit", create_commit)


def test_stock_push_to_hub_uploads_remote_code(monkeypatch):
    hub = _FakeHub(monkeypatch)

    def no_card_yet(cls, repo_id, **kwargs):  # transformers first looks for the repo's existing card
        raise EntryNotFoundError(f"{repo_id} has no README.md yet")

    monkeypatch.setattr(ModelCard, "load", classmethod(no_card_yet))
    model = ResFormerForCausalLM(tiny_config("learnable"))
    model.push_to_hub("someone/tiny-resformer")
    assert hub.repos == ["someone/tiny-resformer"]
    (files,) = hub.commits
    expected_files = {"config.json", "generation_config.json", "model.safetensors", "README.md"} | EXPECTED_CODE_FILES
    assert set(files) == expected_files
    auto_map = json.loads(files["config.json"])["auto_map"]
    assert auto_map["AutoModelForCausalLM"] == "modeling_resformer.ResFormerForCausalLM"


def test_push_with_card_uploads_weights_tokenizer_and_card(monkeypatch, tmp_path):
    hub = _FakeHub(monkeypatch)
    model = ResFormerForCausalLM(tiny_config("learnable"))
    _perturb_lambdas(model)
    commit = resformer_hub.push_with_card(
        model,
        "someone/tiny-resformer",
        tokenizer=_tiny_tokenizer(),
        base_model="someone/tiny-llama",
        init="preserve",
        training={"steps": 12, "final train loss": 3.21},
        license="apache-2.0",
    )
    assert commit == "https://huggingface.co/someone/tiny-resformer/commit/fake"
    assert hub.repos == ["someone/tiny-resformer"]
    (files,) = hub.commits
    assert {"config.json", "generation_config.json", "model.safetensors", "README.md", "tokenizer.json",
            "tokenizer_config.json"} | EXPECTED_CODE_FILES <= set(files)
    assert not any(name.endswith((".bin", ".pt", ".pkl")) for name in files)
    auto_map = json.loads(files["config.json"])["auto_map"]
    assert auto_map == resformer_hub.full_auto_map() and len(auto_map) == 6

    card = ModelCard(files["README.md"].decode("utf-8"))
    assert card.data.base_model == "someone/tiny-llama" and card.data.license == "apache-2.0"
    assert card.data.library_name == "transformers" and card.data.pipeline_tag == "text-generation"
    assert 'from_pretrained("someone/tiny-resformer", trust_remote_code=True)' in card.content
    rows = re.findall(r"^\| (\d+) \| (?:yes|no) \| (-?[\d.]+) \| (-?[\d.]+) \|$", card.content, re.MULTILINE)
    printed = torch.tensor([[float(first), float(own)] for _, first, own in rows])
    assert torch.allclose(printed, model.value_residual_lambdas(), atol=5e-5)

    # The uploaded weights are the model's, λ included.
    (weights_path := tmp_path / "w.safetensors").write_bytes(files["model.safetensors"])
    weights = load_file(weights_path)
    for name, tensor in model.state_dict().items():
        if name in weights:
            assert torch.equal(weights[name], tensor), name
    assert "model.value_residual.lambda_first_offset" in weights


def test_save_for_hub_refuses_a_plain_llama(tmp_path):
    from transformers import LlamaConfig, LlamaForCausalLM

    llama = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                         num_attention_heads=2))
    with pytest.raises(TypeError, match="convert_llama_checkpoint"):
        resformer_hub.save_for_hub(llama, tmp_path)



def test_a_misspelt_card_fact_fails_before_anything_is_written(tmp_path):
    """The publishing functions pass the card's facts on as `**facts`; a keyword the card does not take is still a
    `TypeError` at the call, not after the weights are on disk."""
    model = ResFormerForCausalLM(tiny_config("learnable"))
    with pytest.raises(TypeError, match="base_modle"):
        resformer_hub.save_for_hub(model, tmp_path / "saved", base_modle="meta-llama/Llama-3.2-1B")
    with pytest.raises(TypeError, match="base_modle"):
        resformer_hub.finish_hub_folder(tmp_path / "finished", model.config, base_modle="meta-llama/Llama-3.2-1B")
    assert not any(tmp_path.iterdir())

def test_deprecated_push_to_hub_name_warns_and_pushes_with_the_card(monkeypatch):
    hub = _FakeHub(monkeypatch)
    model = ResFormerForCausalLM(tiny_config("learnable"))
    with pytest.warns(FutureWarning, match="use resformer_hf.hub.push_with_card"):
        resformer_hub.push_to_hub(model, "someone/old-name", license="apache-2.0")
    (files,) = hub.commits
    assert ModelCard(files["README.md"].decode("utf-8")).data.license == "apache-2.0"


def test_every_publishing_path_finishes_the_folder_the_same_way(tmp_path):
    """The converter and `save_for_hub` (the quickstart's writer) share one finisher: remote code, a full auto_map and
    `use_cache: true` (a Trainer leaves it false on the model it trained), whatever the model's own config says."""
    from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

    from resformer_hf import convert_llama_checkpoint

    llama = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                         num_attention_heads=2, use_cache=False))
    llama.save_pretrained(tmp_path / "llama")
    convert_llama_checkpoint(tmp_path / "llama", tmp_path / "converted", progress=False)
    model = ResFormerForCausalLM(tiny_config("learnable_plus"))
    model.config.use_cache = False  # as Trainer(gradient_checkpointing=True) leaves it
    resformer_hub.save_for_hub(model, tmp_path / "saved")
    assert model.config.use_cache is False  # the caller's model is not changed

    for folder in ("converted", "saved"):
        config = json.loads((tmp_path / folder / "config.json").read_text())
        assert config["use_cache"] is True and config["auto_map"] == resformer_hub.full_auto_map()
        assert {path.name for path in (tmp_path / folder).glob("*.py")} == EXPECTED_CODE_FILES
        assert ModelCard.load(tmp_path / folder / "README.md").data.library_name == "transformers"
        loaded = AutoModelForCausalLM.from_pretrained(tmp_path / folder)
        assert cache_of(loaded(torch.tensor([[1, 2, 3]]))) is not None


def test_upload_folder_to_hub_skips_what_hf_upload_skips(monkeypatch, tmp_path):
    """A folder from `hf download --local-dir` (`.cache/huggingface/`), a `.git`, bytecode and a staging file of an
    interrupted `--refresh-code`: the upload holds what `HfApi.upload_folder` (`hf upload`) would, less the last 2."""
    hub = _FakeHub(monkeypatch)
    names = ["config.json", "model.safetensors", ".gitattributes", "sub/notes.txt", ".cache/huggingface/.gitignore",
             ".cache/huggingface/download/model.safetensors.metadata", "sub/.cache/huggingface/lock", ".git/HEAD",
             "__pycache__/modeling_resformer.cpython-311.pyc", ".modeling_resformer.py.ab12cd34.tmp"]
    for name in names:
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_bytes(name.encode())
    resformer_hub.upload_folder_to_hub(tmp_path, "someone/folder")
    monkeypatch.setattr(huggingface_hub.hf_api, "is_xet_available", lambda: False)  # its one-commit path, offline
    HfApi().upload_folder(folder_path=tmp_path, repo_id="someone/folder")
    ours, hf_upload = hub.commits
    ours_only_skips = {"__pycache__/modeling_resformer.cpython-311.pyc", ".modeling_resformer.py.ab12cd34.tmp"}
    assert set(ours) == set(hf_upload) - ours_only_skips
    assert set(ours) == {"config.json", "model.safetensors", ".gitattributes", "sub/notes.txt"}
    assert all(content == name.encode() for name, content in ours.items())


def test_saved_folders_say_how_the_model_samples(tmp_path):
    """save_pretrained alone writes only token ids into generation_config.json, and each reader fills in the rest its
    own way (`generate()` and `transformers serve` greedy, vLLM at temperature 1): the Hub writer adds OpenAI's
    defaults, so the folder samples when loaded; a model whose generation config says greedy stays greedy."""
    model = ResFormerForCausalLM(tiny_config("svformer")).eval()
    resformer_hub.save_for_hub(model, tmp_path / "unset")
    written = json.loads((tmp_path / "unset" / "generation_config.json").read_text())
    assert {key: written.get(key) for key in resformer_hub.SAMPLING_DEFAULTS} == resformer_hub.SAMPLING_DEFAULTS
    loaded = ResFormerForCausalLM.from_pretrained(tmp_path / "unset").eval()
    prompt = torch.randint(3, loaded.config.vocab_size, (1, 4))
    draws = set()
    for seed in range(3):
        torch.manual_seed(seed)
        draws.add(tuple(loaded.generate(prompt, max_new_tokens=12, pad_token_id=0)[0].tolist()))
    assert len(draws) == 3
    model.generation_config.do_sample = False
    resformer_hub.save_for_hub(model, tmp_path / "greedy")
    written = json.loads((tmp_path / "greedy" / "generation_config.json").read_text())
    assert written["do_sample"] is False and "temperature" not in written
