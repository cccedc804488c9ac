"""What a forward pass without gradient (decoding, evaluation, serving) resolves once for every layer's value path.

`ValueResidual(inference=True)` (`value_residual.py`) reads the λ once per forward pass into one `LayerMix` per layer,
and each layer's value path (`value_paths.py`) mixes on v_proj's output with it; with a gradient the paths use the
fused functions of `fused_mixing.py` instead. Imports only torch (copied for `trust_remote_code`).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import nn

# Training mixes through `fused_mixing.py`, whose autograd functions fold λ_self into v_proj's weight to keep no extra
# tensor for backward; at decode that rescales the whole [H_kv·D, hidden] weight per layer per token. Without a
# gradient the values are mixed after the projection instead: O(H_kv·D) per token, the weight never touched.

#: Up to this many tokens per forward pass (a decode step, a speculative draft) layer 0 scales V_0 for all R receivers
#: in one op; beyond it (a prompt's prefill) each receiver scales V_0 when it runs, so that prefill holds one scaled
#: copy of V_0 at a time instead of R (R·B·H_kv·T·D elements: more than the cache's values for long prompts).
BATCHED_SCALING_MAX_TOKENS = 16


class ScaledPerReceiver(NamedTuple):
    """λ_first[r]·V_0 for receiver r, computed when receiver r asks for it (long inputs; see above)."""

    values: torch.Tensor  #: V_0 [B, H_kv, T, D]
    first: tuple[torch.Tensor, ...]  #: one [1, 1, 1, 1] λ_first per receiver, in the values' dtype

    def __getitem__(self, row: int) -> torch.Tensor:
        return self.values * self.first[row]


class LayerMix(NamedTuple):
    """One layer's λ in a forward pass that needs no gradient (`ValueResidual(inference=True)`): Python numbers where
    they read for free (`readable_as_numbers`), else tensors. What a layer does with them is its value path's."""

    #: λ_first: this layer's, as a float; learnable λ as tensors: every receiver's [R, 1, 1, 1, 1] column (layer 0
    #: scales V_0 with it), or `dense`'s offsets [R, L]
    first: float | torch.Tensor
    own: float | torch.Tensor  #: λ_self: a float, or a 0-dim tensor for a receiver whose learnable λ are tensors


def readable_as_numbers(module: nn.Module) -> bool:
    """Whether `module`'s own parameters can be read as Python numbers for free in a pass without gradient.

    Not under `torch.compile` (reading a tensor's value breaks the graph), nor off the CPU (each read would wait for
    the device), nor for sharded parameters (FSDP2 DTensors, DeepSpeed ZeRO-3). Reading a CPU tensor dispatches no op.
    """
    if torch.compiler.is_compiling():
        return False
    return all(type(p) is nn.Parameter and p.device.type == "cpu" and not hasattr(p, "ds_id")
               for p in module._parameters.values())


def needs_value_gradients(model: nn.Module, inputs_embeds: torch.Tensor) -> bool:
    """Whether this forward pass may be differentiated, so the fused training mix (`fused_mixing.py`) must run.

    True when autograd is recording and anything the mix depends on can want a gradient: the input embeddings or any
    parameter of the model (LoRA adapters included). `torch.no_grad()`, `generate()` and frozen models take the
    value paths' mix without gradient (`value_paths.py`), which computes the same values with Llama's ops plus one
    per mixing layer.
    """
    if not torch.is_grad_enabled():
        return False
    return inputs_embeds.requires_grad or any(parameter.requires_grad for parameter in model.parameters())
