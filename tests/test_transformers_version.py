"""The transformers requirement: remote code under an older transformers stops with one line naming the requirement
(instead of `StrictDataclassDefinitionError` from deep inside the config class), and the package metadata and the
model card state the same version as the check."""

from __future__ import annotations

import configparser
import re
import runpy
from pathlib import Path

import pytest
import transformers

import resformer_hf
from resformer_hf import ResFormerForCausalLM
from resformer_hf.configuration_resformer import MIN_TRANSFORMERS_VERSION

from helpers import run_fresh_python, tiny_config
from pypi_cache import FetchError, pip_target

CONFIG_FILE = Path(resformer_hf.__file__).parent / "configuration_resformer.py"
REPO = Path(__file__).resolve().parents[1]
NEEDS = f"ResFormer needs transformers >= {MIN_TRANSFORMERS_VERSION}, found "

LOAD_REMOTE = """
import importlib.util, json, sys
import transformers

report = {"transformers": transformers.__version__}
report["plugin_importable"] = importlib.util.find_spec("resformer_hf") is not None
try:
    transformers.AutoModelForCausalLM.from_pretrained(sys.argv[1], trust_remote_code=True)
    report["error"] = None
except Exception as error:
    report["error"] = f"{type(error).__name__}: {error}"
print("REPORT " + json.dumps(report))
"""


@pytest.mark.parametrize(("version", "refused"), [("4.57.6", True), ("5.22.1", True), ("5.23.0", False),
                                                  ("5.23.0.dev0", False), ("6.0.0", False)])
def test_the_config_file_checks_the_transformers_version_before_anything_else(version, refused, monkeypatch):
    monkeypatch.setattr(transformers, "__version__", version)
    if refused:
        with pytest.raises(ImportError) as caught:
            runpy.run_path(str(CONFIG_FILE))
        message = str(caught.value)
        assert message.startswith(NEEDS + version) and "\n" not in message
    else:
        assert runpy.run_path(str(CONFIG_FILE))["ResFormerConfig"].model_type == "resformer"


@pytest.mark.slow
def test_remote_code_under_transformers_4_57_fails_with_one_line(tmp_path):
    """A real transformers 4.57 (the one `optimum-cli export onnx` installs), fetched into the test cache."""
    try:
        old = pip_target("transformers-4.57", "transformers==4.57.6", "huggingface_hub==0.36.2", "tokenizers==0.22.2")
    except FetchError as error:
        pytest.skip(f"needs transformers 4.57 from PyPI: {error}")
    ResFormerForCausalLM(tiny_config()).save_pretrained(tmp_path / "folder")
    report = run_fresh_python(LOAD_REMOTE, tmp_path, str(tmp_path / "folder"), extra_path=[old])
    assert report["transformers"] == "4.57.6" and report["plugin_importable"] is False
    assert report["error"] == f"ImportError: {NEEDS}4.57.6: pip install -U 'transformers>={MIN_TRANSFORMERS_VERSION}'"


def test_package_metadata_and_card_state_the_checked_version():
    setup = configparser.ConfigParser()
    setup.read(REPO / "setup.cfg")
    requirements = setup["options"]["install_requires"]
    assert re.search(rf"^transformers>={re.escape(MIN_TRANSFORMERS_VERSION)}\b", requirements, re.MULTILINE)
    for card in (REPO / "model_cards" / "resformer.md", CONFIG_FILE.parent / "model_card_template.md"):
        text = card.read_text()
        assert f"`transformers>={MIN_TRANSFORMERS_VERSION}`" in text
        assert "pip install resformer-hf" not in text and "pypi.org/project/resformer-hf" not in text
