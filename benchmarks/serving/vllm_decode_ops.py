"""Decode cost through vLLM, counted: the ops of one decode step of vLLM's model, and the fusions vLLM's fusers gave
each layer, for every variant against a Llama of the same shape in the same run.

vLLM's Transformers modeling backend fuses a model only where its fusers can read the modeling code (q/k/v into one
`QKVParallelLinear`, gate/up into one GEMM, RMSNorm into vLLM's kernel); what it does not fuse runs as separate ops.
On a GPU every op is a kernel launch, so the op count of a decode step is the cost a GPU would see. Counted exactly
(aten ops, views excluded, plus vLLM's custom ops; the counter of `tests/test_kernel_budgets.py`) inside vLLM's model
runner on its CPU backend, eager: machine load does not move them. vLLM's GPU build cannot be installed on the GPU
this project gets to use, so served tokens/s on a GPU stay unmeasured (docs/serving.md).

Needs vLLM (docs/serving.md); run it in that virtualenv from the repository root:

    python -m benchmarks.serving.vllm_decode_ops --label after

Each `--label` is kept in `results/vllm_decode_ops.json` (a label run again replaces its own entry) and the report
`results/vllm_decode_ops.md` shows every label side by side, so a change to the modeling code is measured before and
after. Folders are served from their remote code with vLLM's `model_impl="transformers"`, the plugin hidden (every
engine runs in a fresh interpreter, `tests/vllm_serving.py`).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

RESULTS = Path(__file__).resolve().parents[1] / "results"
REPO_ROOT = Path(__file__).resolve().parents[2]
#: Models measured: config fields on top of the shape (the Llama is `LlamaForCausalLM` of the same shape).
MODELS = {
    "llama": None,
    **{variant: dict(value_residual=variant) for variant in (
        "none", "identity", "constant", "learnable", "learnable_plus", "sparse", "dense", "svformer", "neutreno",
        "denseformer", "gated")},
    "value_embeddings": dict(value_residual="none", value_embeddings="alternating"),
    "learnable_plus+value_embeddings": dict(value_residual="learnable_plus", value_embeddings="alternating"),
    "cla2": dict(value_residual="none", cross_layer_attention=2),
}
#: vLLM's CPU attention needs head size 32, 64, 80, ...; 8 layers so per-layer costs dominate the per-step ones.
SHAPE = dict(vocab_size=512, hidden_size=128, intermediate_size=352, num_hidden_layers=8, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=256, tie_word_embeddings=False)
PROMPT_TOKENS, NEW_TOKENS = 16, 4


def build_folders(root: Path) -> dict[str, Path]:
    """A Hub folder per model, every mixing parameter (λ, gates, tables) off its initial value."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from resformer_hf import ResFormerConfig, ResFormerForCausalLM
    from resformer_hf.hub import save_for_hub

    folders = {}
    for name, fields in MODELS.items():
        torch.manual_seed(0)
        folders[name] = root / name.replace("+", "_")
        if fields is None:
            LlamaForCausalLM(LlamaConfig(**SHAPE)).save_pretrained(folders[name])
            continue
        model = ResFormerForCausalLM(ResFormerConfig(**SHAPE, **fields)).eval()
        with torch.no_grad():
            for parameter_name, parameter in model.named_parameters():
                if any(part in parameter_name for part in ("value_residual", "value_gate", "depth_weighted",
                                                           "value_embedding")):
                    parameter.uniform_(-0.4, 0.4)
        save_for_hub(model, folders[name])
    return folders


def decode_step(op_counts: list[dict]) -> dict[str, int]:
    """The ops of the first decode step (the pass after the prompt's), checked equal to every later one's."""
    first, *later = op_counts[1:]
    assert all(step == first for step in later), "decode steps differ in their ops"
    return first


def layer_fusions(fusions: list[dict]) -> dict[str, int]:
    """How many layers got each fusion."""
    return {
        "qkv": sum("qkv_proj" in layer["attention"] for layer in fusions),
        # a layer without v_proj (SVFormer n >= 1): q and k as one GEMM, vLLM's `MergedColumnParallelLinear`
        "qk": sum(any(name.startswith("merged_proj") for name in layer["attention"]) for layer in fusions),
        "gate_up": sum("gate_up_proj" in layer["mlp"] for layer in fusions),
        "norms": sum(all(layer["norms"].values()) for layer in fusions),
    }


def measure() -> dict[str, dict]:
    sys.path.insert(0, str(REPO_ROOT / "tests"))
    from vllm_serving import run_engine

    with tempfile.TemporaryDirectory() as scratch:
        folders = build_folders(Path(scratch))
        prompt = list(range(3, 3 + PROMPT_TOKENS))
        runs = [dict(name=name, folder=str(folder), prompts=[prompt], max_tokens=NEW_TOKENS, count_ops=True)
                for name, folder in folders.items()]
        job = dict(import_plugin=False, runs=runs, engine_args=dict(skip_tokenizer_init=True))  # token ids in
        results = run_engine(job, Path(scratch) / "engine", hide_plugin=True, timeout=3600)
    return {name: dict(ops=decode_step(result["op_counts"]), fusions=layer_fusions(result["fusions"]))
            for name, result in results.items()}


def report(measured: dict[str, dict]) -> str:
    from benchmarks.common import markdown_table

    labels = list(measured)
    header = ["model", *(f"{label}: ops / decode step" for label in labels),
              *(f"{label}: vs Llama" for label in labels), *(f"{label}: layers fused (qkv, gate/up, norms)"
                                                             for label in labels)]
    rows = []
    for name in MODELS:
        cells = [f"`{name}`"]
        totals = {label: sum(entry["models"][name]["ops"].values()) if name in entry["models"] else None
                  for label, entry in measured.items()}
        llama = {label: sum(entry["models"]["llama"]["ops"].values()) for label, entry in measured.items()}
        cells += [str(totals[label]) if totals[label] is not None else "—" for label in labels]
        cells += [f"{totals[label] - llama[label]:+d}" if totals[label] is not None else "—" for label in labels]
        for label in labels:
            fused = measured[label]["models"].get(name, {}).get("fusions")
            qkv = "—" if fused is None else f"{fused['qkv']}" + (f" (+{fused['qk']} q+k)" if fused.get("qk") else "")
            cells.append(qkv if fused is None else f"{qkv}, {fused['gate_up']}, {fused['norms']}")
        rows.append(cells)
    layers = SHAPE["num_hidden_layers"]
    notes = [f"- `{label}`: {entry['environment']} Commit {entry['commit']}." for label, entry in measured.items()]
    return "\n".join([
        "# Decode cost through vLLM: ops of one decode step, and the fusions vLLM gave each layer",
        "",
        "Regenerate: `python -m benchmarks.serving.vllm_decode_ops --label LABEL` in the vLLM virtualenv "
        "(docs/serving.md); each label is kept in `vllm_decode_ops.json`.",
        f"Shape: hidden {SHAPE['hidden_size']}, {layers} layers, {SHAPE['num_attention_heads']} query heads, "
        f"{SHAPE['num_key_value_heads']} kv heads, head dim {SHAPE['hidden_size'] // SHAPE['num_attention_heads']}, "
        f"float32, every λ, gate and table off its initial value. Served by vLLM's Transformers modeling backend from "
        "each folder's remote code (`model_impl=\"transformers\"`, the plugin hidden), eager, one sequence of "
        f"{PROMPT_TOKENS} prompt tokens; the ops of the first decode step (every later step's are the same). Ops: "
        "aten ops (views excluded) and vLLM's custom ops, counted inside vLLM's model runner; on a GPU each is a "
        f"kernel launch. *Layers fused*: of the {layers} decoder layers, how many have q/k/v as one "
        "`QKVParallelLinear` (and, where a layer has no v_proj, q and k as one GEMM), gate/up as one GEMM, and every "
        "norm as vLLM's RMSNorm.",
        "",
        markdown_table(header, rows),
        "",
        *notes,
        "",
    ])


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--label", required=True, help="the name this run is kept under (e.g. before, after)")
    args = parser.parse_args(argv)

    import torch
    import vllm

    from benchmarks.common import environment_line

    store = RESULTS / "vllm_decode_ops.json"
    measured = json.loads(store.read_text()) if store.exists() else {}
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO_ROOT, capture_output=True,
                            text=True).stdout.strip() or "unknown"
    measured[args.label] = dict(
        models=measure(), commit=commit,
        environment=f"{environment_line(torch.device('cpu'))} vLLM {vllm.__version__}, CPU backend.",
    )
    store.write_text(json.dumps(measured, indent=1) + "\n")
    text = report(measured)
    (RESULTS / "vllm_decode_ops.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
