"""Helpers shared by the tests: tiny configs and models, and the Trainer pieces of the fine-tuning example.

Imported by name (`from helpers import ...`); pytest puts `tests/` on `sys.path`. Fixtures live in `conftest.py`.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedModel, Trainer

from resformer_hf import ResFormerConfig, ResFormerForCausalLM
from resformer_hf.examples.finetune import BLOCK_SIZE, TEXT_CHARS, VOCAB_SIZE, build_model, training_arguments
from resformer_hf.remote_code._compat import with_cache
from resformer_hf.remote_code.variants import VARIANTS
from resformer_hf.text import block_dataset, sample_text, train_tokenizer

#: The size most tests use: 4 layers, GQA (4 query heads, 2 kv heads), small enough for exhaustive per-variant tests.
TINY = dict(
    vocab_size=128,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=128,
    pad_token_id=0,
    bos_token_id=1,
    eos_token_id=2,
)


def tiny_config(variant: str = "learnable_plus", **overrides) -> ResFormerConfig:
    """A `TINY` ResFormer config of `variant`."""
    return ResFormerConfig(**{**TINY, "value_residual": variant, **overrides})


def model_with_random_lambdas(config: ResFormerConfig, bound: float = 0.4) -> ResFormerForCausalLM:
    """A tiny causal LM (eval mode) whose learnable λ offsets (and DenseFormer's depth-weight offsets, `gated`'s value
    gates) are uniform in ±bound, so trained-looking λ are exercised rather than the initial values."""
    model = ResFormerForCausalLM(config).eval()
    with torch.no_grad():
        for parameter in mixing_parameters(model).values():
            parameter.uniform_(-bound, bound)
    return model


def mixing_parameters(model) -> dict[str, torch.nn.Parameter]:
    """Every parameter that decides how values (or, DenseFormer, block outputs) mix, by name: the λ offsets, the depth
    weights and the value gates; the ones `model_with_random_lambdas` moves off their initial values."""
    return {name: parameter for name, parameter in model.named_parameters()
            if any(part in name.split(".") for part in ("value_residual", "depth_weighted_average", "value_gate"))}


# Non-default λ for every variant that takes them, so the reference checks the fields are really read.
NON_DEFAULT = {
    "none": {},
    "identity": {"value_residual_layers": [1, 3]},
    "constant": {"value_residual_lambda_first": 1.5, "value_residual_lambda_self": 0.7},
    "learnable": {"value_residual_lambda_first": 0.3, "value_residual_lambda_self": 0.9},
    "learnable_plus": {"value_residual_lambda_self": 0.8, "value_residual_lambda_scale": 2.5},
    "sparse": {"value_residual_lambda_first": 3.0, "value_residual_lambda_self": 0.8},
    "dense": {"value_residual_lambda_first": 0.4, "value_residual_lambda_self": 0.6, "value_residual_layers": [2, 3]},
    "svformer": {},
    "neutreno": {"neutreno_lambda": 0.7, "value_residual_layers": [2, 3]},
    "denseformer": {"denseformer_dilation": 2},
    "gated": {"value_residual_lambda_first": 0.3, "value_residual_layers": [1, 3]},
}


def randomised_model(variant: str, **overrides) -> ResFormerForCausalLM:
    """A tiny model whose learnable λ offsets are random, so trained-looking λ are exercised."""
    return model_with_random_lambdas(tiny_config(variant, **{**NON_DEFAULT[variant], **overrides}))


def assert_attention_backends_agree(model, tolerance: float = 1e-5) -> None:
    """Eager, sdpa and flex attention give `model` the same logits on a left-padded batch (padding exercises the
    backends' mask handling), compared where the mask keeps tokens."""
    input_ids = torch.randint(3, 128, (2, 10))
    mask = torch.ones_like(input_ids)
    mask[1, :3] = 0
    logits = {}
    for backend in ("eager", "sdpa", "flex_attention"):
        model.set_attn_implementation(backend)
        with torch.no_grad():
            logits[backend] = model(input_ids, attention_mask=mask).logits
    keep = mask.bool()
    for backend in ("sdpa", "flex_attention"):
        assert (logits[backend][keep] - logits["eager"][keep]).abs().max().item() <= tolerance, backend


def enable_checkpointing(model, use_reentrant: bool) -> None:
    """transformers 5.23 renamed `gradient_checkpointing_enable` (still there, deprecated) to
    `activation_checkpointing_enable`; use the release's own name."""
    if hasattr(model, "activation_checkpointing_enable"):
        model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": use_reentrant})
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": use_reentrant})


def disable_checkpointing(model) -> None:
    (getattr(model, "activation_checkpointing_disable", None) or model.gradient_checkpointing_disable)()


def assert_checkpointing_keeps_the_gradients(model, use_reentrant: bool) -> dict[str, torch.Tensor]:
    """A training step's gradients with gradient checkpointing equal those without (every layer checkpointed); returns
    the plain ones."""
    model.train()
    input_ids = torch.randint(3, 128, (2, 9))

    def gradients():
        model.zero_grad()
        model(input_ids, labels=input_ids).loss.backward()
        return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    plain = gradients()
    enable_checkpointing(model, use_reentrant)
    assert all(layer.gradient_checkpointing for layer in model.model.layers)
    checkpointed = gradients()
    disable_checkpointing(model)
    assert plain.keys() == checkpointed.keys()
    for name in plain:
        assert torch.allclose(plain[name], checkpointed[name], atol=1e-6, rtol=1e-5), name
    return plain


def assert_compiled_training_keeps_the_gradients(model) -> dict[str, torch.Tensor]:
    """A training step compiled into one graph (`fullgraph=True`, AOTAutograd, forward and backward) gives eager's
    gradients; returns the eager ones."""
    import torch._dynamo

    model.train()
    input_ids = torch.randint(3, 128, (2, 9))

    def gradients(forward):
        model.zero_grad(set_to_none=True)
        forward(input_ids, labels=input_ids, use_cache=False).loss.backward()
        return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    eager = gradients(model)
    torch._dynamo.reset()
    compiled = gradients(torch.compile(model, backend="aot_eager", fullgraph=True))
    assert compiled.keys() == eager.keys()
    for name in eager:
        assert torch.allclose(compiled[name], eager[name], atol=1e-6, rtol=1e-5), name
    return eager


def decode_logits(forward, model, prompt: torch.Tensor, steps: int, cache) -> tuple[list[torch.Tensor], torch.Tensor]:
    """Greedy decoding one token at a time through `forward` with `cache`: each step's last logits, all tokens."""
    tokens, step_logits = prompt, []
    logits = model(prompt, **with_cache(cache), use_cache=True).logits[:, -1]
    for _ in range(steps):
        step_logits.append(logits)
        tokens = torch.cat((tokens, logits.argmax(-1, keepdim=True)), dim=1)
        logits = forward(tokens[:, -1:], **with_cache(cache), use_cache=True).logits[:, -1]
    return step_logits, tokens


def llama_config_like(config: ResFormerConfig) -> LlamaConfig:
    """The `LlamaConfig` of a plain Llama with the same shape as the ResFormer `config`."""
    llama_fields = LlamaConfig().to_dict()
    fields = {k: v for k, v in config.to_dict().items() if k in llama_fields and k not in ("model_type", "auto_map")}
    return LlamaConfig(**fields)


def llama_pair(variant: str = "learnable_plus", seed: int = 0, **overrides):
    """(Llama, ResFormer) with the same weights that compute the same function: the ResFormer's λ start at the
    variant's output-preserving values (λ_first = 0, λ_self = 1), so every difference a client shows is the client's
    handling of the model type, not the architecture. Both in eval mode."""
    spec_fields = VARIANTS[variant].preserving_fields or {}
    config = tiny_config(variant, **{**spec_fields, **overrides})
    torch.manual_seed(seed)
    llama = LlamaForCausalLM(llama_config_like(config)).eval()
    resformer = ResFormerForCausalLM(config).eval()
    missing, unexpected = resformer.load_state_dict(llama.state_dict(), strict=False)
    tables = ".self_attn.value_embedding"  # value embeddings: zero at first, the Llama's outputs exactly
    assert not unexpected and all(key.startswith("model.value_residual.") or tables in key for key in missing), missing
    return llama, resformer


#: Prepended to a fresh interpreter's script: the top-level modules named in `sys.argv[1]` (a JSON list) look not
#: installed (every import finder returns no spec for them, so `import` fails and `importlib.util.find_spec` is None,
#: as transformers' availability checks expect), so only remote code copied next to a checkpoint can run.
BLOCK_MODULES = textwrap.dedent(
    """
    import json, sys

    class HideModules:
        blocked = set(json.loads(sys.argv.pop(1)))

        def __init__(self, finder):
            self.finder = finder

        def find_spec(self, name, path=None, target=None):
            if name.partition(".")[0] in self.blocked:
                return None
            return self.finder.find_spec(name, path, target)

        def __getattr__(self, attribute):
            return getattr(self.finder, attribute)

    sys.meta_path[:] = [HideModules(finder) for finder in sys.meta_path]
    """
)


def run_fresh_python(
    script: str, workdir: Path, *args: str, blocked=("resformer_hf",), timeout: int = 300, extra_path=()
) -> dict:
    """Run `script` in a fresh offline interpreter that cannot import the `blocked` top-level modules (by default
    this package), with `extra_path` first on `sys.path`; returns the JSON it printed after "REPORT "."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONSTARTUP")}
    env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", HF_MODULES_CACHE=str(Path(workdir) / "modules"))
    if extra_path:
        env["PYTHONPATH"] = os.pathsep.join(str(path) for path in extra_path)
    result = subprocess.run(
        [sys.executable, "-c", BLOCK_MODULES + textwrap.dedent(script), json.dumps(list(blocked)), *args],
        cwd=workdir, env=env, stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=timeout,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.rpartition("REPORT ")[2])


#: Checkpoint folders `client_checkpoints` writes: the source Llama, and ResFormers made from it.
CLIENT_FOLDERS = ("llama", "resformer_preserve", "learnable_plus", "svformer", "dense")


def client_checkpoints(root: Path) -> dict[str, Path]:
    """Folders (weights + tokenizer) that client-library tests load as a user would: a small random Llama
    ("llama"), its conversion that computes the same function ("resformer_preserve": `learnable_plus`,
    `init="preserve"`), conversions with the paper's λ ("learnable_plus", "svformer"), and a `dense` ResFormer
    (not convertible) with the Llama's weights and random λ."""
    from resformer_hf import convert_llama_checkpoint
    from resformer_hf.text import sample_text, train_tokenizer

    tokenizer = train_tokenizer([sample_text(TEXT_CHARS)], VOCAB_SIZE)
    special = {f"{name}_token_id": getattr(tokenizer, f"{name}_token_id") for name in ("pad", "bos", "eos")}
    shape = {**TINY, **special, "vocab_size": len(tokenizer), "hidden_size": 64, "intermediate_size": 128,
             "max_position_embeddings": 256}
    folders = {name: Path(root) / name for name in CLIENT_FOLDERS}
    torch.manual_seed(0)
    llama = LlamaForCausalLM(LlamaConfig(**shape)).eval()
    llama.save_pretrained(folders["llama"])
    tokenizer.save_pretrained(folders["llama"])
    convert_llama_checkpoint(folders["llama"], folders["resformer_preserve"], variant="learnable_plus", progress=False)
    for variant in ("learnable_plus", "svformer"):
        convert_llama_checkpoint(folders["llama"], folders[variant], variant=variant, init="paper", progress=False)
    dense = model_with_random_lambdas(ResFormerConfig(**shape, value_residual="dense"))
    dense.load_state_dict(llama.state_dict(), strict=False)
    dense.save_pretrained(folders["dense"])
    tokenizer.save_pretrained(folders["dense"])
    return folders


def save_with_scalar_lambda_scale(model: PreTrainedModel, folder: str | Path) -> None:
    """Save `model` as checkpoints were written before λ became at least 1-D: `lambda_scale_offset` as a 0-dim
    tensor (one safetensors file)."""
    model.save_pretrained(folder)
    path = Path(folder) / "model.safetensors"
    tensors = load_file(path)
    key = "model.value_residual.lambda_scale_offset"
    tensors[key] = tensors[key].reshape(())
    save_file(tensors, path, metadata={"format": "pt"})


def example_data():
    """(tokenizer, block dataset) of the fine-tuning example: the same text, tokenizer and blocks it trains on."""
    text = sample_text(TEXT_CHARS)
    tokenizer = train_tokenizer([text], VOCAB_SIZE)
    return tokenizer, block_dataset(tokenizer, [text], BLOCK_SIZE)


def step_losses(trainer: Trainer) -> list[float]:
    """The training loss of every logged step, in order."""
    return [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]


__all__ = [
    "assert_checkpointing_keeps_the_gradients",
    "disable_checkpointing",
    "enable_checkpointing",
    "assert_attention_backends_agree",
    "BLOCK_MODULES",
    "CLIENT_FOLDERS",
    "BLOCK_SIZE",
    "TINY",
    "VOCAB_SIZE",
    "build_model",
    "client_checkpoints",
    "decode_logits",
    "example_data",
    "llama_config_like",
    "llama_pair",
    "NON_DEFAULT",
    "mixing_parameters",
    "model_with_random_lambdas",
    "randomised_model",
    "run_fresh_python",
    "save_with_scalar_lambda_scale",
    "step_losses",
    "tiny_config",
    "training_arguments",
]
