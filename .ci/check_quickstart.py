"""Check what `resformer-quickstart` did, as CI does after running it (.ci/run, .ci/wheel).

The held-out loss it reported went down, and the folder it wrote loads with `AutoModelForCausalLM` and generates.
`--plugin` says where the model classes must come from: `installed` (this environment's installed, non-editable
`resformer_hf`, loaded without `trust_remote_code`) or `absent` (`resformer_hf` is not importable here: the folder's
own remote code). `--save-logits FILE` keeps the logits and greedy tokens of a fixed prompt, `--expect-logits FILE`
compares with them, so the remote code is checked against the package that wrote the folder.
"""

from __future__ import annotations

import argparse
import importlib.util
import re
import sys
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM, AutoTokenizer

PROMPT = "The"


def held_out_loss(log: Path) -> tuple[float, float]:
    """(before, after) from the quickstart's last `held-out loss X -> Y` line; fails unless it went down."""
    found = re.findall(r"held-out loss (\d+\.\d+) -> (\d+\.\d+)", log.read_text(encoding="utf-8"))
    assert found, f"{log} reports no held-out loss"
    before, after = map(float, found[-1])
    assert after < before, f"the quickstart's held-out loss did not go down: {before} -> {after}"
    return before, after


def load(folder: Path, plugin: str | None) -> torch.nn.Module:
    """The folder's causal LM, from the classes `plugin` names (None: remote code, whatever is installed)."""
    if plugin == "installed":
        import resformer_hf  # registers the plugin's classes with the Auto classes

        where = Path(resformer_hf.__file__).resolve()
        assert Path(sys.prefix).resolve() in where.parents, f"resformer_hf comes from {where}, not {sys.prefix}"
        model = AutoModelForCausalLM.from_pretrained(folder)
        assert type(model).__module__.startswith("resformer_hf."), type(model).__module__
    else:
        if plugin == "absent":
            assert importlib.util.find_spec("resformer_hf") is None, "resformer_hf is importable in this process"
        model = AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True)
        if plugin == "absent":
            assert type(model).__module__.startswith("transformers_modules."), type(model).__module__
    assert type(model).__name__ == "ResFormerForCausalLM", type(model)
    return model.eval()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("log", type=Path, help="what the quickstart printed")
    parser.add_argument("folder", type=Path, help="the folder it wrote")
    parser.add_argument("--plugin", choices=("installed", "absent"))
    parser.add_argument("--save-logits", type=Path, metavar="FILE")
    parser.add_argument("--expect-logits", type=Path, metavar="FILE")
    args = parser.parse_args()

    before, after = held_out_loss(args.log)
    model = load(args.folder, args.plugin)
    ids = AutoTokenizer.from_pretrained(args.folder, trust_remote_code=True)(PROMPT, return_tensors="pt").input_ids
    with torch.no_grad():
        found = {"logits": model(ids).logits, "tokens": model.generate(ids, max_new_tokens=4, do_sample=False)}
    assert found["tokens"].shape[1] == ids.shape[1] + 4, found["tokens"].shape
    if args.save_logits:
        save_file(found, args.save_logits)
    if args.expect_logits:
        expected = load_file(args.expect_logits)
        torch.testing.assert_close(found["logits"], expected["logits"])
        assert torch.equal(found["tokens"], expected["tokens"]), (found["tokens"], expected["tokens"])
    origin = {"installed": "the installed package", "absent": "its remote code, no plugin"}.get(args.plugin, "")
    print(f"quickstart checked: held-out loss {before} -> {after}; {args.folder} loads"
          f"{' from ' + origin if origin else ''} and generates"
          f"{', same logits and tokens as ' + str(args.expect_logits) if args.expect_logits else ''}")


if __name__ == "__main__":
    main()
