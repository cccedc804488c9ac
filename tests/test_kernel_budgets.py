"""Kernel budgets of the value residual: the aten ops (views excluded) a variant adds to a same-shape Llama's, per
receiving layer and per step, in a bf16 training step and in a decode step, counted exactly (machine load does not
move them).

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
from resformer_hf.remote_code.variants import VARIANTS

from helpers import llama_config_like, model_with_random_lambdas, tiny_config

SHAPE = dict(vocab_size=512, hidden_size=128, intermediate_size=352, num_attention_heads=8, num_key_value_heads=4,
             max_position_embeddings=64, tie_word_embeddings=False)
DEPTHS = (8, 12)
TENSORS = "decode (λ as tensors)"

#: Ops each variant adds to a same-shape Llama's (views excluded; every op of a kind Llama runs fewer of counts, an
#: op it replaces is not netted against them), per receiving layer (DenseFormer: per block) and once per step. Held
#: at what they are (issues 55, 66), so that a growth of one op a layer fails; lower them when a change lowers them.
#: Training is a bf16-autocast step over float32 weights: v_proj then reads a cast of h of its own, so a mix that
#: scales V_n (identity's λ_self = 0.5, learnable λ) pays for that scale in an op of its own (with bf16 or float32
#: weights the mix computes v_proj's gradients itself and λ_self rides on their GEMMs: identity adds 2).
#: - fixed λ: the mix (1), V_0's gradient summed over the receivers (1), identity's λ_self on V_n's gradient (1);
#:   layer 0 scales V_0 once for every receiver (2 a step);
#: - learnable λ: the mix (2), both scaled gradients in one op, the two λ dots, V_0's gradient (1 each); the λ table
#:   (learnable_plus: softmax, λ_scale, stack, cast and their backward) a step;
#: - `dense` and DenseFormer: their weight tables and the value buffer's first rows, a step;
#: - NeuTRENO recomputes its corrected o_proj input in backward (2 ops) rather than keep a tensor Llama does not;
#: - gated: its gate is a GEMM of its own on x̂[..., :12] (autocast's casts of W_g, b_g and the slice and of their
#:   gradients, its mm, addmm and sum, the slice's gradient written into h's), its sigmoid and the lerp.
TRAINING = {"identity": (3, 2), "constant": (2, 2), "learnable": (6, 5), "learnable_plus": (6, 12), "sparse": (2, 2),
            "neutreno": (9, 0), "dense": (5, 12), "gated": (20, 0), "denseformer": (5, 10)}
#: A decode step: each receiver's mix is one op (layer 0 scales V_0 for all of them at once).
DECODE = {"identity": (1, 1), "constant": (1, 1), "learnable": (1, 3), "learnable_plus": (1, 6), "sparse": (1, 1),
          "neutreno": (2, 0), "dense": (2, 4), "gated": (3, 0), "denseformer": (2, 4)}


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


def extra_kernels(variant: str, kind: str) -> tuple[float, float, float, dict]:
    """(ops added per receiving layer, ops added per step, ops removed per receiving layer, the differences by name
    at 12 layers) against Llama's."""
    count = training_kernels if kind == "training" else decode_kernels
    added, removed, layers = {}, {}, {}
    for depth in DEPTHS:
        config = tiny_config(variant, **SHAPE, num_hidden_layers=depth)
        torch.manual_seed(0)
        llama = count(LlamaForCausalLM(llama_config_like(config)))
        ops = count(model_with_random_lambdas(config))
        by_name = {name: ops[name] - llama[name] for name in ops.keys() | llama.keys() if ops[name] != llama[name]}
        added[depth] = sum(difference for difference in by_name.values() if difference > 0)
        removed[depth] = -sum(difference for difference in by_name.values() if difference < 0)
        receivers = len(config.value_residual_receivers)
        layers[depth] = depth if VARIANTS[variant].depth_weighted_average else receivers
    if layers[DEPTHS[1]] == layers[DEPTHS[0]]:  # `none`: no layer receives anything at either depth
        return float(added[DEPTHS[1]] - added[DEPTHS[0]]) or 0.0, added[DEPTHS[0]], removed[DEPTHS[0]], by_name
    per_layer, fewer = ((table[DEPTHS[1]] - table[DEPTHS[0]]) / (layers[DEPTHS[1]] - layers[DEPTHS[0]])
                        for table in (added, removed))
    return per_layer, added[DEPTHS[0]] - per_layer * layers[DEPTHS[0]], fewer, by_name


@pytest.mark.parametrize("kind", ["training", TENSORS])
def test_the_value_residual_stays_within_its_kernel_budget(variant, kind):
    per_layer, per_step, fewer, by_name = extra_kernels(variant, kind)
    if variant == "none":  # Llama itself
        assert (per_layer, per_step, fewer) == (0, 0, 0), by_name
        return
    if VARIANTS[variant].drops_value_projections:  # SVFormer: no v_proj after layer 0, cheaper than Llama
        assert per_layer == 0 and per_step <= 0 and fewer > 0, (per_layer, per_step, by_name)
        return
    budget = (TRAINING if kind == "training" else DECODE)[variant]
    assert per_layer <= budget[0] and per_step <= budget[1], (per_layer, per_step, by_name)


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
        print(name, *(f"{kind}: {extra_kernels(name, kind)[:3]}" for kind in ("training", TENSORS)))
