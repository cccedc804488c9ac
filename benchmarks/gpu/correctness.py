"""Item 2 of the GPU run: every variant and option computes what the paper's equations say, on the device.

Each case is a tiny model (4 layers, grouped-query attention) with its λ moved off their initial values and its
queries and keys sharpened (so greedy tokens depend on which values a cache returns). What it is held to is
independent of the package: `tests/reference.py`, a plain-torch ResFormer written from the equations, run on the CPU
in float64; a same-shape HF `LlamaForCausalLM` is the control throughout.

- float32 with TF32 off: logits of a no-grad forward (prompts of 8 and 40 tokens: the GPU's λ-as-tensors path, both
  sides of `BATCHED_SCALING_MAX_TOKENS`) and of a forward with gradient, and the gradient of every parameter, within
  1e-4 of the reference (relative L2 norm).
- bfloat16 (weights cast; and float32 weights under autocast, as training runs): the same errors, reported next to the
  Llama control's, and held to three times the control's error (bf16 keeps 8 bits: the control's error is what bf16
  costs a model of this shape, not a tolerance picked after the fact).
- `attn_implementation` eager, sdpa and flex_attention: each within 1e-4 of the reference.
- Greedy tokens of `generate()` without a cache equal those with a dynamic cache, a static cache, and a static cache
  with the decode step compiled (`CompileConfig(fullgraph=True)`: what `generate()` does by default on a GPU, with
  the whole graph required).
- Continuous batching (`generate_batch`, the plugin's paged cache) on prompts of mixed lengths equals `generate()`.
"""

from __future__ import annotations

import contextlib
import sys
from pathlib import Path

import torch
from transformers import CompileConfig, ContinuousBatchingConfig, GenerationConfig, LlamaConfig, LlamaForCausalLM

from resformer_hf import ResFormerConfig, ResFormerForCausalLM
from resformer_hf.remote_code.variants import VARIANTS

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests"))
from reference import reference_logits  # noqa: E402  (the test suite's independent plain-torch model)

PART = "correctness"
LLAMA = "llama"
#: Every variant, and the options that change what is cached: cross-layer attention alone and with the two variants
#: that combine with it.
CASES: dict[str, dict] = {
    LLAMA: {},
    **{variant: dict(value_residual=variant) for variant in VARIANTS},
    "cla2": dict(value_residual="none", cross_layer_attention=2),
    "svformer_cla2": dict(value_residual="svformer", cross_layer_attention=2),
    "denseformer_cla2": dict(value_residual="denseformer", cross_layer_attention=2, denseformer_dilation=2),
}
SIZE = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=256, pad_token_id=0, bos_token_id=1, eos_token_id=2)
FP32_TOLERANCE = 1e-4
BF16_FACTOR = 3.0
PROMPT_LENGTHS = (8, 40)
ATTENTION = ("eager", "sdpa", "flex_attention")
NEW_TOKENS = 10
BATCH_PROMPTS = (3, 17, 41, 9)


def build_case(name: str, seed: int = 0) -> torch.nn.Module:
    """The tiny model of case `name` (float32, CPU, eval): random weights, queries and keys ×4, λ offsets (and
    DenseFormer's depth-weight offsets, `gated`'s value gates) uniform in ±0.4."""
    torch.manual_seed(seed)
    if name == LLAMA:
        model = LlamaForCausalLM(LlamaConfig(**SIZE))
    else:
        model = ResFormerForCausalLM(ResFormerConfig(**SIZE, **CASES[name]))
    with torch.no_grad():
        for layer in model.model.layers:
            for projection in (layer.self_attn.q_proj, getattr(layer.self_attn, "k_proj", None)):
                if projection is not None:
                    projection.weight.mul_(4)
        mixing = ("model.value_residual.", "model.depth_weighted_average.")
        for parameter_name, parameter in model.named_parameters():  # module order: the λ draws of before
            if parameter_name.startswith(mixing) or ".value_gate." in parameter_name:
                parameter.uniform_(-0.4, 0.4)
    return model.eval()


def relative_error(output: torch.Tensor, reference: torch.Tensor) -> float:
    difference = (output.detach().double().cpu() - reference.detach().double()).norm()
    scale = reference.detach().double().norm()
    return float(difference / scale) if scale > 0 else float(difference)


def reference_config(model) -> object:
    """The config the reference reads: a Llama control reads as a ResFormer without value residual."""
    if isinstance(model, ResFormerForCausalLM):
        return model.config
    return ResFormerConfig(**SIZE, value_residual="none")


def reference_pass(model, input_ids: torch.Tensor, probe: torch.Tensor) -> tuple[torch.Tensor, dict]:
    """The reference's logits and the gradient of `(logits · probe).sum()` for every parameter, float64 on the CPU."""
    state = {name: tensor.detach().cpu().double().requires_grad_() for name, tensor in model.state_dict().items()}
    logits = reference_logits(reference_config(model), state, input_ids.cpu())
    used = {name: tensor for name, tensor in state.items() if tensor.requires_grad}
    grads = torch.autograd.grad((logits * probe.double()).sum(), list(used.values()), allow_unused=True)
    return logits.detach(), {name: grad for name, grad in zip(used, grads) if grad is not None}


def model_pass(model, input_ids: torch.Tensor, probe: torch.Tensor, autocast: torch.dtype | None = None):
    """The model's no-grad logits, and its logits and parameter gradients with gradient, on its device."""
    device = next(model.parameters()).device
    ids = input_ids.to(device)
    context = torch.autocast(device.type, dtype=autocast) if autocast else contextlib.nullcontext()
    with torch.no_grad(), context:
        no_grad_logits = model(ids).logits.float()
    model.zero_grad(set_to_none=True)
    with context:
        logits = model(ids).logits.float()
    (logits * probe.to(device)).sum().backward()
    grads = {name: p.grad.detach().float() for name, p in model.named_parameters() if p.grad is not None}
    return no_grad_logits, logits.detach(), grads


#: Parameters of the value residual and DenseFormer (λ, depth weights): a Llama has none.
MIXING_PREFIXES = ("model.value_residual.", "model.depth_weighted_average.")


def gradient_error(grads: dict[str, torch.Tensor], reference: dict[str, torch.Tensor]) -> tuple[float, str]:
    """The largest relative error over the weights a Llama also has, and over the mixing parameters taken as one
    vector (and the worst's name). One vector because a single λ's gradient can be a sum that nearly cancels (λ_scale
    in `learnable_plus`), where a relative error measures the cancellation, not the mix. A parameter the reference
    differentiates but the model does not (or the reverse) is an error of 1."""
    missing = [name for name in set(grads) ^ set(reference) if float(grads.get(name, reference.get(name)).norm())]
    if missing:
        return 1.0, sorted(missing)[0]
    mixing = sorted(name for name in reference if name.startswith(MIXING_PREFIXES))
    errors = {name: relative_error(grads[name], reference[name]) for name in reference if name not in mixing}
    if mixing:
        errors["mixing parameters"] = relative_error(torch.cat([grads[name].flatten().cpu() for name in mixing]),
                                                     torch.cat([reference[name].flatten() for name in mixing]))
    worst = max(errors, key=errors.get)
    return errors[worst], worst


@contextlib.contextmanager
def exact_float32():
    """float32 matrix products and convolutions in full precision (TF32 off) on the GPU, restored afterwards; through
    the `fp32_precision` settings where torch has them (2.9+: mixing them with the older `allow_tf32` flags is an
    error)."""
    settings = [torch.backends.cuda.matmul, getattr(torch.backends.cudnn, "conv", None)]
    settings = [setting for setting in settings if hasattr(setting, "fp32_precision")]
    if not settings:
        saved = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
        try:
            yield
        finally:
            torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved
        return
    saved = [setting.fp32_precision for setting in settings]
    for setting in settings:
        setting.fp32_precision = "ieee"
    try:
        yield
    finally:
        for setting, value in zip(settings, saved):
            setting.fp32_precision = value


def check_numerics(recorder, name: str, device: torch.device, control: dict | None) -> dict:
    """float32 and bf16 logits and gradients against the reference; returns the bf16 errors (the control's, for
    Llama)."""
    generator = torch.Generator().manual_seed(7)
    errors = {}
    for length in PROMPT_LENGTHS:
        ids = torch.randint(3, SIZE["vocab_size"], (2, length), generator=generator)
        probe = torch.randn(2, length, SIZE["vocab_size"], generator=generator)
        model = build_case(name).to(device)
        ref_logits, ref_grads = reference_pass(model, ids, probe)
        with exact_float32():
            no_grad, logits, grads = model_pass(model, ids, probe)
        grad_error, grad_name = gradient_error(grads, ref_grads)
        fp32 = dict(no_grad_logits=relative_error(no_grad, ref_logits), logits=relative_error(logits, ref_logits),
                    grads=grad_error)
        recorder.write(PART, f"{name}/float32/T{length}", ok=max(fp32.values()) <= FP32_TOLERANCE,
                       tolerance=FP32_TOLERANCE, worst_grad=grad_name, **fp32)
        _, logits, grads = model_pass(model, ids, probe, autocast=torch.bfloat16)
        cast = build_case(name).to(device, torch.bfloat16)
        with torch.no_grad():
            bf16_logits = cast(ids.to(device)).logits.float()
        grad_error, grad_name = gradient_error(grads, ref_grads)
        bf16 = dict(bf16_weights_logits=relative_error(bf16_logits, ref_logits),
                    autocast_logits=relative_error(logits, ref_logits), autocast_grads=grad_error)
        errors[length] = bf16
        limits = {key: BF16_FACTOR * value for key, value in (control or {}).get(length, bf16).items()}
        recorder.write(PART, f"{name}/bfloat16/T{length}", ok=all(bf16[key] <= limits[key] for key in bf16),
                       limits=limits, worst_grad=grad_name, **bf16)
    return errors


def check_attention_implementations(recorder, name: str, device: torch.device, implementations) -> None:
    ids = torch.randint(3, SIZE["vocab_size"], (2, 40), generator=torch.Generator().manual_seed(8))
    model = build_case(name).to(device)
    reference = reference_pass(model, ids, torch.zeros(2, 40, SIZE["vocab_size"]))[0]
    errors = {}
    with exact_float32(), torch.no_grad():
        for implementation in implementations:
            model.set_attn_implementation(implementation)
            errors[implementation] = relative_error(model(ids.to(device)).logits, reference)
    recorder.write(PART, f"{name}/attention", ok=max(errors.values()) <= FP32_TOLERANCE, tolerance=FP32_TOLERANCE,
                   **errors)


def greedy(model, prompt: torch.Tensor, **options) -> list[list[int]]:
    config = GenerationConfig(max_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=None, pad_token_id=0)
    with exact_float32():
        output = model.generate(prompt.to(model.device), generation_config=config, **options)
    return output[:, prompt.shape[1]:].tolist()


def compile_options(smoke: bool) -> dict:
    """`generate()`'s compiled static cache with the whole graph required; off the GPU (smoke runs) the trace only,
    through dynamo's eager backend, which `generate()` uses only when told to compile on every device."""
    config = CompileConfig(fullgraph=True, **({"backend": "eager"} if smoke else {}))
    if smoke:
        config._compile_all_devices = True
    return dict(cache_implementation="static", compile_config=config)


def check_cache_paths(recorder, name: str, device: torch.device, compiled: bool, smoke: bool) -> None:
    """Greedy tokens without a cache equal those with each cache (and the compiled static one when `compiled`)."""
    prompt = torch.randint(3, SIZE["vocab_size"], (2, 12), generator=torch.Generator().manual_seed(9))
    model = build_case(name).to(device)
    uncached = greedy(model, prompt, use_cache=False)
    if compiled:
        paths = {"static+compile(fullgraph)": compile_options(smoke)}
    else:
        paths = {"dynamic": {}, "static": dict(cache_implementation="static", disable_compile=True)}
    equal = {path: greedy(model, prompt, **options) == uncached for path, options in paths.items()}
    recorder.write(PART, f"{name}/cache{'/compiled' if compiled else ''}", ok=all(equal.values()), **equal)


def check_continuous_batching(recorder, name: str, device: torch.device) -> None:
    generator = torch.Generator().manual_seed(10)
    prompts = [torch.randint(3, SIZE["vocab_size"], (n,), generator=generator).tolist() for n in BATCH_PROMPTS]
    model = build_case(name).to(device)
    expected = [greedy(model, torch.tensor([prompt]))[0] for prompt in prompts]
    config = GenerationConfig(max_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=None, pad_token_id=0)
    with exact_float32():
        outputs = model.generate_batch(prompts, generation_config=config,
                                       continuous_batching_config=ContinuousBatchingConfig(num_blocks=16,
                                                                                           max_batch_tokens=64))
    got = {int(request.rsplit("_", 1)[1]): list(output.generated_tokens) for request, output in outputs.items()}
    tokens = [got.get(index) for index in range(len(prompts))]
    recorder.write(PART, f"{name}/continuous_batching", ok=tokens == expected,
                   equal_requests=sum(a == b for a, b in zip(tokens, expected)), requests=len(prompts))


#: The smoke run's cases: the control, the default variant, and the one that changes what every cache holds most.
SMOKE_CASES = [LLAMA, "learnable_plus", "svformer_cla2"]


def run(recorder, schedule, plan) -> None:
    """Every case eagerly first (seconds each), then the compiled static cache for as many as the time allows.
    flex_attention compiles its kernel even when the model is eager (a minute of C++ on a CPU): the smoke run leaves it
    out."""
    device, smoke = plan.device, plan.smoke
    cases = plan.pick(list(CASES), SMOKE_CASES)
    implementations = [name for name in ATTENTION if not (smoke and name == "flex_attention")]
    control = None
    for name in cases:
        if not schedule.allows(2.0):
            recorder.write(PART, name, ok=None, skipped="time")
            continue
        with recorder.guarded(PART, f"{name}/numerics"):
            errors = check_numerics(recorder, name, device, control)
            control = errors if name == LLAMA else control
        with recorder.guarded(PART, f"{name}/attention"):
            check_attention_implementations(recorder, name, device, implementations)
        with recorder.guarded(PART, f"{name}/cache"):
            check_cache_paths(recorder, name, device, compiled=False, smoke=smoke)
        with recorder.guarded(PART, f"{name}/continuous_batching"):
            check_continuous_batching(recorder, name, device)
    for name in cases:
        if not schedule.allows(8.0):
            recorder.write(PART, f"{name}/cache/compiled", ok=None, skipped="time")
            continue
        with recorder.guarded(PART, f"{name}/cache/compiled"):
            check_cache_paths(recorder, name, device, compiled=True, smoke=smoke)
