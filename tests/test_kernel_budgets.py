"""Kernel budgets of the value residual: aten ops (views excluded) beyond a same-shape Llama's, per receiving layer and
per step, in a bf16 training step and in a decode step, counted exactly (machine load does not move them).

On a GPU each op is a kernel launch (~5 µs) and a pass over its tensors, which is what made the default variant's
training step 5 % slower than Llama's before the λ became one table and each mix one op. Counted at 8 and 12 layers,
so that a per-layer cost cannot hide inside the per-step allowance. The decode step keeps learnable λ as tensors, as
every device runs it; its CPU dispatches are held in `test_decode_ops.py` and its instructions in
`test_decode_instructions.py`.
"""

from __future__ import annotations

import collections

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from transformers import DynamicCache, LlamaForCausalLM

from resformer_hf.remote_code._compat import with_cache
from resformer_hf.remote_code.cache_resformer import share_cache_storage
from resformer_hf.remote_code.configuration_resformer import VARIANTS

from helpers import llama_config_like, model_with_random_lambdas, tiny_config

SHAPE = dict(vocab_size=512, hidden_size=128, intermediate_size=352, num_attention_heads=8, num_key_value_heads=4,
             max_position_embeddings=64, tie_word_embeddings=False)
DEPTHS = (8, 12)
TENSORS = "decode (λ as tensors)"

#: The issue's budgets: extra kernels per receiving layer (DenseFormer: per block) and once per step.
TRAINING = {"identity": 3, "constant": 6, "learnable": 6, "learnable_plus": 6, "sparse": 6, "neutreno": 6,
            "dense": 8, "gated": 10, "denseformer": 6}
DECODE = {"identity": 1, "constant": 1, "learnable": 1, "learnable_plus": 1, "sparse": 1, "neutreno": 2, "dense": 2,
          "gated": 3, "denseformer": 2}
PER_STEP = {"training": 8, "decode": 4}
#: Where torch ops do not reach the budget, the counts measured (per layer, per step), held so that they cannot grow:
#: - learnable_plus's table (softmax, λ_scale, stack, cast, and their backward): 12 ops a step, 6 without gradient;
#: - `dense` and DenseFormer: their weight tables and the value buffer's first rows, 12 and 10 ops a step;
#: - NeuTRENO recomputes its corrected o_proj input in backward (2 ops) rather than keep a tensor Llama does not;
#: - gated's gate is a GEMM of its own (casts of W_g and b_g and of their gradients, its own mm, addmm and sum).
#: The rest is fusion beyond torch ops (the λ-gradient dots with V_0's gradient, the gate with v_proj's GEMM).
MEASURED_ABOVE = {("training", "learnable_plus"): (6, 12), ("training", "dense"): (5, 12),
                  ("training", "denseformer"): (5, 10), ("training", "neutreno"): (9, 0),
                  ("training", "gated"): (15, 0), ("decode", "learnable_plus"): (1, 6)}


#: Ops that wait for the host or make it wait: a tensor from Python data (`torch.tensor(...)` enters dispatch as
#: `lift_fresh`, which counts as a view), and `.item()` / `.tolist()`.
SYNCS = ("lift_fresh", "lift_fresh_copy", "_local_scalar_dense")


class KernelCount(TorchDispatchMode):
    """Counts every aten op dispatched below autograd that is not a view, and every host sync (`SYNCS`)."""

    def __init__(self):
        super().__init__()
        self.ops = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if not func.is_view or name in SYNCS:
            self.ops[name] += 1
        return func(*args, **(kwargs or {}))


def training_kernels(model) -> collections.Counter:
    """Forward and backward of one bf16-autocast training step without a cache, after a warm-up step."""
    model.train()
    input_ids = torch.randint(3, SHAPE["vocab_size"], (2, 16), generator=torch.Generator().manual_seed(0))

    def step():
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = model(input_ids, labels=input_ids, use_cache=False).loss
        loss.backward()
        model.zero_grad(set_to_none=True)

    step()
    with KernelCount() as count:
        step()
    return count.ops


@torch.no_grad()
def decode_kernels(model) -> collections.Counter:
    """One decode step with a dynamic cache holding 16 tokens."""
    model.eval()
    prompt = torch.randint(3, SHAPE["vocab_size"], (1, 16), generator=torch.Generator().manual_seed(0))
    cache = share_cache_storage(DynamicCache(config=model.config), model.config)
    token = model(prompt, **with_cache(cache), use_cache=True).logits[:, -1:].argmax(-1)
    with KernelCount() as count:
        model(token, **with_cache(cache), use_cache=True)
    return count.ops


def extra_kernels(variant: str, kind: str) -> tuple[float, float, dict]:
    """(per receiving layer, per step, the extra ops by name at 12 layers) beyond Llama's."""
    count = training_kernels if kind == "training" else decode_kernels
    extra, layers = {}, {}
    for depth in DEPTHS:
        config = tiny_config(variant, **SHAPE, num_hidden_layers=depth)
        torch.manual_seed(0)
        llama = count(LlamaForCausalLM(llama_config_like(config)))
        model = model_with_random_lambdas(config)
        ops = count(model)
        extra[depth] = sum(ops.values()) - sum(llama.values())
        by_name = {name: ops[name] - llama[name] for name in ops.keys() | llama.keys() if ops[name] != llama[name]}
        receivers = len(config.value_residual_receivers)
        layers[depth] = depth if VARIANTS[variant].depth_weighted_average else receivers
    deeper = extra[DEPTHS[1]] - extra[DEPTHS[0]]
    if layers[DEPTHS[1]] == layers[DEPTHS[0]]:  # `none`: no layer receives anything at either depth
        return (0.0 if deeper == 0 else float("inf")), extra[DEPTHS[0]], by_name
    per_layer = deeper / (layers[DEPTHS[1]] - layers[DEPTHS[0]])
    return per_layer, extra[DEPTHS[0]] - per_layer * layers[DEPTHS[0]], by_name


def limits(kind: str, variant: str) -> tuple[float, float]:
    """(per layer, per step) this variant may add: its budget, or what was measured where that is above it."""
    step = "training" if kind == "training" else "decode"
    budget = ((TRAINING if step == "training" else DECODE)[variant], PER_STEP[step])
    above = MEASURED_ABOVE.get((step, variant), (0, 0))
    return max(budget[0], above[0]), max(budget[1], above[1])


@pytest.mark.parametrize("kind", ["training", TENSORS])
def test_the_value_residual_stays_within_its_kernel_budget(variant, kind):
    per_layer, per_step, by_name = extra_kernels(variant, kind)
    if variant == "none":  # Llama itself
        assert (per_layer, per_step) == (0, 0), by_name
        return
    if VARIANTS[variant].drops_value_projections:  # SVFormer: no v_proj after layer 0, cheaper than Llama
        assert per_layer < 0 and per_step <= 0, (per_layer, per_step, by_name)
        return
    layer_limit, step_limit = limits(kind, variant)
    assert per_layer <= layer_limit and per_step <= step_limit, (per_layer, per_step, by_name)


def test_a_training_step_builds_no_tensor_from_python_data_and_reads_none_back(variant):
    """On a GPU a tensor made from Python data is a blocking host→device copy, and `.item()` waits for the device:
    a training step (forward and backward) does neither more often than Llama's (whose loss and masks do a few).
    `lift_fresh` is how `torch.tensor(...)` enters dispatch, `_local_scalar_dense` how `.item()` / `.tolist()` do."""
    config = tiny_config(variant, **SHAPE, num_hidden_layers=4)
    torch.manual_seed(0)
    llama = training_kernels(LlamaForCausalLM(llama_config_like(config)))
    ops = training_kernels(model_with_random_lambdas(config))
    assert [ops[name] for name in SYNCS] == [llama[name] for name in SYNCS], ops


def test_a_decode_step_reads_no_number_back_beyond_llamas(variant):
    """A decode step builds no tensor from Python data and reads none back beyond Llama's: on a GPU an `.item()` in
    the forward (a λ or a gate's shift read as a number) or a `torch.tensor(...)` of λ would wait for the device at
    every step. (A CPU tensor's `.tolist()` reads its memory without dispatch, so a CPU-only numbers path would not
    show here; `test_core_model`'s λ changed through `.data` holds that no cache of λ outlives a step.)"""
    config = tiny_config(variant, **SHAPE, num_hidden_layers=4)
    torch.manual_seed(0)
    llama = decode_kernels(LlamaForCausalLM(llama_config_like(config)))
    ops = decode_kernels(model_with_random_lambdas(config))
    assert [ops[name] for name in SYNCS] == [llama[name] for name in SYNCS], ops


if __name__ == "__main__":  # the table of counts, for the issue and the docs
    for name in VARIANTS:
        print(name, *(f"{kind}: {extra_kernels(name, kind)[:2]}" for kind in ("training", TENSORS)))
