"""The supported transformers releases (5.19 to the newest tested): one code base, never a silent wrong answer.

- An older transformers stops with one line naming the requirement; a newer, untested one gets one warning at import.
- setup.cfg's range, the README and the model card state exactly the tested range.
- A ResFormer forward that is handed a KV cache under a name it does not read raises instead of ignoring it.
- Hub folders written on one supported release load bit-exact, without the plugin, on another; cached == uncached.
- Importing the plugin prints nothing beyond what importing transformers' Llama prints.

The oldest release is fetched with pip into the test cache (`pypi_cache`) and run in fresh interpreters next to the
installed one; when pip cannot fetch it the tests fail in CI and skip, naming it, elsewhere (`pypi_cache.unavailable`).
"""

from __future__ import annotations

import configparser
import runpy
import warnings
from pathlib import Path

import pytest
import torch
import transformers
from transformers import AutoModelForCausalLM, DynamicCache, GenerationMixin

import resformer_hf
from resformer_hf import ResFormerForCausalLM
from resformer_hf.hub import finish_hub_folder
from resformer_hf.remote_code import _compat
from resformer_hf.remote_code._compat import OLDEST_SUPPORTED, UntestedTransformersWarning, supported_range, with_cache

from helpers import model_with_random_lambdas, run_fresh_python, tiny_config
from pypi_cache import FetchError, pip_target, unavailable

COMPAT_FILE = Path(_compat.__file__)
REPO = Path(__file__).resolve().parents[1]
TESTS = Path(__file__).resolve().parent
NEEDS = f"ResFormer needs transformers >= {OLDEST_SUPPORTED}, found "
OLDEST_RELEASE = f"{OLDEST_SUPPORTED}.0"
VARIANTS = ["identity", "constant", "learnable", "learnable_plus", "sparse", "dense", "svformer", "neutreno", "gated"]


def oldest_release() -> Path:
    try:
        return pip_target(f"transformers-{OLDEST_RELEASE}", f"transformers=={OLDEST_RELEASE}")
    except FetchError as error:
        unavailable(f"needs transformers {OLDEST_RELEASE} from PyPI", error)


# ---- the range -----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("version", "refused", "warned"), [
    ("4.57.6", True, False), ("5.18.2", True, False), ("5.19.0", False, False), ("5.23.0.dev0", False, False),
    (f"{_compat.NEWEST_TESTED}.3", False, False), ("5.99.0", False, True), ("6.0.0", False, True),
])
def test_the_range_is_checked_before_anything_else(version, refused, warned, monkeypatch):
    monkeypatch.setattr(transformers, "__version__", version)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        if refused:
            with pytest.raises(ImportError) as error:
                runpy.run_path(str(COMPAT_FILE))
            message = str(error.value)
            assert message == f"{NEEDS}{version}: pip install -U '{supported_range()}'"
            return
        runpy.run_path(str(COMPAT_FILE))
    untested = [w for w in caught if w.category.__name__ == UntestedTransformersWarning.__name__]
    assert len(untested) == int(warned)
    if warned:
        text = str(untested[0].message)
        assert f"found {version}" in text and supported_range() in text and "\n" not in text


def test_package_metadata_readme_and_card_state_the_tested_range():
    setup = configparser.ConfigParser()
    setup.read(REPO / "setup.cfg")
    requirements = setup["options"]["install_requires"].split()
    assert supported_range() in requirements
    for text in ((REPO / "README.md").read_text(), (REPO / "docs" / "supported-releases.md").read_text(),
                 (REPO / "model_cards" / "resformer.md").read_text(),
                 (Path(resformer_hf.__file__).parent / "hub" / "model_card_template.md").read_text()):
        assert f"`{supported_range()}`" in text
    template = Path(resformer_hf.__file__).parent / "hub" / "model_card_template.md"
    for card in (REPO / "model_cards" / "resformer.md", template):
        text = card.read_text()
        assert "pip install resformer-hf" not in text and "pypi.org/project/resformer-hf" not in text


def test_release_table_lists_every_minor_release_of_the_tested_range():
    """docs/supported-releases.md's table has a row for each release from the oldest supported to the newest tested,
    so raising `NEWEST_TESTED` without adding its row (or the reverse) fails here."""
    text = (REPO / "docs" / "supported-releases.md").read_text()
    assert text.count("<!-- releases:begin -->") == 1 and text.count("<!-- releases:end -->") == 1
    table = text.split("<!-- releases:begin -->")[1].split("<!-- releases:end -->")[0]
    rows = [line for line in table.splitlines() if line.startswith("|")][2:]  # below the header and its rule
    listed = [release.strip() for row in rows for release in row.split("|")[1].split(",")]
    assert listed[0] == OLDEST_RELEASE, listed
    assert listed[-1].rpartition(".")[0] == _compat.NEWEST_TESTED, listed
    oldest, newest = (int(version.split(".")[1]) for version in (OLDEST_SUPPORTED, _compat.NEWEST_TESTED))
    assert [release.rpartition(".")[0] for release in listed] == [f"5.{minor}" for minor in range(oldest, newest + 1)]



def test_the_torch_floor_is_the_torch_ci_tests_at_both_ends():
    """setup.cfg's `torch>=X.Y`, the README's requirement and the oldest virtualenv of "Run the tests" (which .ci/run
    runs) name the same torch; the newest one is tested there too, and the README's range names both (issue 27: 2.6
    was admitted, never tested; issue 49: the newest moved to 2.15.0)."""
    setup = configparser.ConfigParser()
    setup.read(REPO / "setup.cfg")
    (floor,) = [req.removeprefix("torch>=") for req in setup["options"]["install_requires"].split()
                if req.startswith("torch>=")]
    readme = " ".join((REPO / "README.md").read_text().split())
    assert f"torch ≥ {floor} (CI runs the core tests on {floor}.0 with transformers {OLDEST_RELEASE}" in readme
    assert f'.venv/oldest/bin/pip install "torch=={floor}.0" "transformers=={OLDEST_RELEASE}"' in readme
    newest = "2.15.0"
    assert f'.venv/newest/bin/pip install "torch=={newest}"' in readme
    assert f"and on {newest} with {_compat.NEWEST_TESTED}." in readme  # the newest transformers, which pip picks
    assert f"torch {floor} to {newest.rpartition('.')[0]} are tested" in readme

@pytest.mark.slow
def test_remote_code_under_transformers_4_57_fails_with_one_line(tmp_path):
    """A real transformers 4.57 (the one `optimum-cli export onnx` installs), fetched into the test cache."""
    try:
        old = pip_target("transformers-4.57", "transformers==4.57.6", "huggingface_hub==0.36.2", "tokenizers==0.22.2")
    except FetchError as error:
        unavailable("needs transformers 4.57 from PyPI", error)
    ResFormerForCausalLM(tiny_config()).save_pretrained(tmp_path / "folder")
    script = """
    import json, sys, transformers
    try:
        transformers.AutoModelForCausalLM.from_pretrained(sys.argv[1], trust_remote_code=True)
        error = None
    except Exception as caught:
        error = f"{type(caught).__name__}: {caught}"
    print("REPORT " + json.dumps({"transformers": transformers.__version__, "error": error}))
    """
    report = run_fresh_python(script, tmp_path, str(tmp_path / "folder"), extra_path=[old])
    assert report["transformers"] == "4.57.6"
    assert report["error"] == f"ImportError: {NEEDS}4.57.6: pip install -U '{supported_range()}'"


# ---- loud, never silent --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["kv_cache", "past_key_value", "layer_past"])
def test_a_cache_under_a_name_the_model_does_not_read_raises(name):
    model = model_with_random_lambdas(tiny_config())
    input_ids = torch.tensor([[5, 6, 7, 8]])
    cache = DynamicCache(config=model.config)
    with pytest.raises(TypeError, match=f"received a KV cache as `{name}`"):
        model(input_ids, use_cache=True, **{name: cache})
    assert cache.get_seq_length() == 0


def test_generate_that_passes_the_cache_under_a_new_name_fails_instead_of_generating(monkeypatch):
    """A future transformers whose `generate()` renames the cache again (simulated: its model inputs carry the cache
    as `kv_cache`) must not get tokens computed without the cache (the 5.24 failure: a fresh cache every step)."""
    model = model_with_random_lambdas(tiny_config())
    prepare = GenerationMixin.prepare_inputs_for_generation

    def renaming(self, *args, **kwargs):
        inputs = prepare(self, *args, **kwargs)
        if inputs.get(_compat.CACHE_ARGUMENT) is not None:
            inputs["kv_cache"] = inputs.pop(_compat.CACHE_ARGUMENT)
        return inputs

    monkeypatch.setattr(GenerationMixin, "prepare_inputs_for_generation", renaming)
    with pytest.raises(TypeError, match="received a KV cache as `kv_cache`"):
        model.generate(torch.tensor([[5, 6, 7]]), max_new_tokens=3, do_sample=False)


def test_two_caches_under_both_names_are_refused():
    """transformers' `deprecate_kwarg` (5.24, Llama) would keep `cache` and drop the other with a warning."""
    model = model_with_random_lambdas(tiny_config())
    kept, dropped = DynamicCache(config=model.config), DynamicCache(config=model.config)
    with pytest.raises(ValueError, match="not both"):
        model.model(torch.tensor([[5, 6]]), cache=kept, past_key_values=dropped, use_cache=True)
    assert (kept.get_seq_length(), dropped.get_seq_length()) == (0, 0)


@pytest.mark.parametrize("variant", ["learnable_plus", "svformer"])
def test_a_cache_as_past_key_values_next_to_cache_none_is_used(variant):
    """What PEFT 0.21's prefix tuning passes on 5.24 (`cache=None, past_key_values=C`): a Llama computes without C
    (`deprecate_kwarg` keeps `cache=None`); a ResFormer uses C, so decoding matches the uncached model."""
    model = model_with_random_lambdas(tiny_config(variant))
    tokens = torch.tensor([[5, 6, 7, 8, 9, 10]])
    cache = DynamicCache(config=model.config)
    model(tokens[:, :4], use_cache=True, **with_cache(cache))
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "`past_key_values` is deprecated", FutureWarning)  # 5.24's rename
        step = model(tokens[:, 4:], use_cache=True, cache=None, past_key_values=cache).logits
    assert cache.get_seq_length() == 6
    assert (step - model(tokens).logits[:, 4:]).abs().max() < 1e-5


@pytest.mark.parametrize("variant", VARIANTS)
def test_cache_passed_under_this_releases_name_is_used(variant):
    model = model_with_random_lambdas(tiny_config(variant))
    tokens = torch.tensor([[5, 6, 7, 8, 9, 10]])
    full = model(tokens).logits[:, -1]
    cache = DynamicCache(config=model.config)
    model(tokens[:, :4], use_cache=True, **with_cache(cache))
    model(tokens[:, 4:5], use_cache=True, **with_cache(cache))
    step = model(tokens[:, 5:], use_cache=True, **with_cache(cache)).logits[:, -1]
    assert cache.get_seq_length() == 6
    torch.testing.assert_close(step, full, atol=1e-5, rtol=1e-5)


# ---- every supported release, side by side -------------------------------------------------------------------------

IMPORT_QUIETLY = """
import contextlib, io, json, sys
import transformers
from transformers import LlamaForCausalLM  # the control: whatever importing transformers' Llama prints
sys.stderr.flush()
captured = io.StringIO()
with contextlib.redirect_stderr(captured), contextlib.redirect_stdout(captured):
    import resformer_hf
    from transformers.utils import logging
print("REPORT " + json.dumps({"transformers": transformers.__version__, "printed": captured.getvalue()}))
"""


@pytest.mark.slow
@pytest.mark.parametrize("release", ["installed", "oldest"])
def test_import_prints_nothing(release, tmp_path):
    extra = [oldest_release(), REPO] if release == "oldest" else [REPO]
    report = run_fresh_python(IMPORT_QUIETLY, tmp_path, blocked=(), extra_path=extra)
    expected = OLDEST_RELEASE if release == "oldest" else transformers.__version__
    assert report["transformers"] == expected
    assert report["printed"] == ""


#: Writes one Hub folder per variant (plugin importable) and the logits / greedy tokens the plugin computes for them.
WRITE_FOLDERS = """
import json, sys
import torch, transformers
sys.path.insert(0, sys.argv[2])
from helpers import model_with_random_lambdas, tiny_config
from resformer_hf.hub import finish_hub_folder
root, variants = sys.argv[1], json.loads(sys.argv[3])
prompt = torch.tensor([[5, 9, 17, 33, 2, 70]])
report = {"transformers": transformers.__version__, "plugin": True, "logits": {}, "tokens": {}}
for variant in variants:
    torch.manual_seed(len(variant))
    model = model_with_random_lambdas(tiny_config(variant))
    folder = f"{root}/{variant}"
    model.save_pretrained(folder)
    finish_hub_folder(folder, model.config)
    with torch.no_grad():
        report["logits"][variant] = model(prompt).logits.tolist()
        report["tokens"][variant] = model.generate(prompt, max_new_tokens=8, do_sample=False).tolist()
print("REPORT " + json.dumps(report))
"""

#: Loads the folders with `trust_remote_code=True` and the plugin not importable; logits, cached and uncached tokens.
READ_FOLDERS = """
import importlib.util, json, sys
import torch, transformers
root, variants = sys.argv[1], json.loads(sys.argv[2])
prompt = torch.tensor([[5, 9, 17, 33, 2, 70]])
report = {"transformers": transformers.__version__, "plugin": importlib.util.find_spec("resformer_hf") is not None,
          "logits": {}, "tokens": {}, "uncached": {}, "classes": {}}
for variant in variants:
    model = transformers.AutoModelForCausalLM.from_pretrained(f"{root}/{variant}", trust_remote_code=True).eval()
    report["classes"][variant] = type(model).__module__
    with torch.no_grad():
        report["logits"][variant] = model(prompt).logits.tolist()
        report["tokens"][variant] = model.generate(prompt, max_new_tokens=8, do_sample=False).tolist()
        report["uncached"][variant] = model.generate(prompt, max_new_tokens=8, do_sample=False,
                                                     use_cache=False).tolist()
print("REPORT " + json.dumps(report))
"""


def write_folders(root: Path, release: str) -> dict:
    import json

    root.mkdir()
    extra = [oldest_release(), REPO] if release == "oldest" else [REPO]
    return run_fresh_python(WRITE_FOLDERS, root.parent, str(root), str(TESTS), json.dumps(VARIANTS), blocked=(),
                            extra_path=extra)


@pytest.mark.slow
# Written and read on the same release is tests/test_hub.py's fresh-process test, which CI also runs in the oldest
# release's virtualenv.
@pytest.mark.parametrize(("writer", "reader"), [("installed", "oldest"), ("oldest", "installed")])
def test_a_folder_written_on_one_release_loads_bit_exact_on_another_without_the_plugin(writer, reader, tmp_path):
    import json

    written = write_folders(tmp_path / "folders", writer)
    extra = [oldest_release()] if reader == "oldest" else []
    read = run_fresh_python(READ_FOLDERS, tmp_path, str(tmp_path / "folders"), json.dumps(VARIANTS), extra_path=extra)
    versions = {"installed": transformers.__version__, "oldest": OLDEST_RELEASE}
    assert (written["transformers"], read["transformers"]) == (versions[writer], versions[reader])
    assert read["plugin"] is False
    for variant in VARIANTS:
        assert read["classes"][variant].startswith("transformers_modules."), variant
        assert read["logits"][variant] == written["logits"][variant], variant  # bit-exact
        assert read["tokens"][variant] == read["uncached"][variant] == written["tokens"][variant], variant


# ---- folders published with older code -----------------------------------------------------------------------------

STALE_MODELING = '''
raise RuntimeError("stale remote code was executed")
'''


def test_with_the_plugin_imported_a_stale_folder_loads_the_plugins_classes(tmp_path):
    model = model_with_random_lambdas(tiny_config("svformer"))
    model.save_pretrained(tmp_path)
    finish_hub_folder(tmp_path, model.config)
    for name in ("modeling_resformer.py", "configuration_resformer.py"):
        (tmp_path / name).write_text(STALE_MODELING)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path, trust_remote_code=True).eval()
    assert type(loaded) is ResFormerForCausalLM
    prompt = torch.tensor([[5, 9, 17, 33]])
    cached = loaded.generate(prompt, max_new_tokens=6, do_sample=False)
    assert torch.equal(cached, loaded.generate(prompt, max_new_tokens=6, do_sample=False, use_cache=False))
    assert torch.equal(cached, model.generate(prompt, max_new_tokens=6, do_sample=False))


def _digests(folder: Path) -> dict[str, str]:
    import hashlib

    return {path.name: hashlib.sha256(path.read_bytes()).hexdigest() for path in sorted(folder.iterdir())
            if path.is_file()}


@pytest.mark.slow
def test_refresh_code_replaces_a_stale_folders_code_in_place_and_nothing_else(tmp_path):
    import json

    from resformer_hf.cli.convert import main as convert_main
    from resformer_hf.registration import full_auto_map

    model = model_with_random_lambdas(tiny_config("learnable_plus"))
    fresh, stale = tmp_path / "fresh", tmp_path / "stale"
    for folder in (fresh, stale):
        model.save_pretrained(folder)
        finish_hub_folder(folder, model.config)
    config = json.loads((stale / "config.json").read_text())
    config["auto_map"].pop("AutoModelForSequenceClassification")
    (stale / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    for name in ("modeling_resformer.py", "_compat.py"):
        (stale / name).write_text(STALE_MODELING)
    before = _digests(stale)

    assert convert_main(["--refresh-code", str(stale)]) == 0
    after = _digests(stale)
    code = {name for name in after if name.endswith(".py")}
    assert code == {name for name in _digests(fresh) if name.endswith(".py")}
    assert all(after[name] == _digests(fresh)[name] for name in code)
    unchanged = set(before) - code - {"config.json"}
    assert unchanged and {"model.safetensors", "README.md"} <= unchanged
    assert all(after[name] == before[name] for name in unchanged)
    refreshed = json.loads((stale / "config.json").read_text())
    assert refreshed["auto_map"] == full_auto_map()
    config.pop("auto_map")
    assert {k: v for k, v in refreshed.items() if k != "auto_map"} == config
    assert not [path for path in stale.iterdir() if path.name.startswith(".")]  # no staging files left

    read = run_fresh_python(READ_FOLDERS, tmp_path, str(tmp_path), json.dumps(["stale"]))
    prompt = torch.tensor([[5, 9, 17, 33, 2, 70]])
    with torch.no_grad():
        assert read["logits"]["stale"] == model(prompt).logits.tolist()
    assert read["tokens"]["stale"] == read["uncached"]["stale"]


def test_refresh_code_refuses_what_is_not_a_resformer_folder(tmp_path, capsys):
    from transformers import LlamaConfig

    from resformer_hf.cli.convert import main as convert_main

    LlamaConfig(num_hidden_layers=1).save_pretrained(tmp_path / "llama")
    (tmp_path / "empty").mkdir()
    (tmp_path / "broken").mkdir()
    (tmp_path / "broken" / "config.json").write_text("{not json")
    cases = (("llama", "model_type 'llama'"), ("empty", "no config.json"), ("broken", "not valid JSON"))
    for folder, message in cases:
        before = _digests(tmp_path / folder)
        assert convert_main(["--refresh-code", str(tmp_path / folder)]) == 2
        error = capsys.readouterr().err
        assert error.startswith("resformer-convert: error:") and message in error and error.count("\n") == 1
        assert _digests(tmp_path / folder) == before
    for argv in (["src", "dst", "--refresh-code", str(tmp_path / "llama")], []):
        with pytest.raises(SystemExit) as exit_info:
            convert_main(argv)
        assert exit_info.value.code == 2 and capsys.readouterr().err.count("\n") == 1


@pytest.mark.parametrize("ci", ["true", "1", None, "false"])
def test_a_failed_download_fails_in_ci_and_skips_elsewhere(monkeypatch, ci):
    from pypi_cache import unavailable

    if ci is None:
        monkeypatch.delenv("CI", raising=False)
    else:
        monkeypatch.setenv("CI", ci)
    expected = pytest.fail.Exception if ci in ("true", "1") else pytest.skip.Exception
    with pytest.raises(expected, match="needs a package: pip failed"):
        unavailable("needs a package", FetchError("pip failed"))
    assert "CI=" in (REPO / ".ci" / "run").read_text()  # CI's script sets it for every test run it starts
