"""Calling a projection exactly as Llama does, and knowing when a fused op may use its weight instead.

Imports only torch and transformers (copied for `trust_remote_code`).
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F
from torch.nn.modules import module as _module_globals

# Global module hooks live in private dicts of torch.nn.modules.module; read only, and a missing name means no hooks.
_GLOBAL_MODULE_HOOKS = tuple(
    getattr(_module_globals, name, {})
    for name in ("_global_forward_pre_hooks", "_global_forward_hooks", "_global_backward_pre_hooks",
                 "_global_backward_hooks")
)
_PLAIN_TENSOR_TYPES = (nn.Parameter, torch.Tensor)


def is_plain_linear(module: nn.Module, linear_class: type[nn.Linear] = nn.Linear) -> bool:
    """Whether calling `module` is exactly `F.linear(x, module.weight, module.bias)`, so a fused op may use its weight.

    False for LoRA, quantised or wrapped modules, hooks or a patched `forward` (tensor parallelism, ZeRO-3,
    offloading) and tensor-subclass weights (DTensor). Reads the module's own dicts: it runs per layer per decode step.
    """
    if type(module) is not linear_class:
        return False
    state = module.__dict__
    if ("forward" in state or state["_forward_hooks"] or state["_forward_pre_hooks"] or state["_backward_hooks"]
            or state["_backward_pre_hooks"] or any(_GLOBAL_MODULE_HOOKS)):
        return False
    parameters = state["_parameters"]
    bias = parameters["bias"]
    return type(parameters["weight"]) in _PLAIN_TENSOR_TYPES and (bias is None or type(bias) in _PLAIN_TENSOR_TYPES)


def plain_linear_weight(module: nn.Module) -> torch.Tensor | None:
    """The weight of a bias-free `is_plain_linear` module, else None."""
    if not is_plain_linear(module) or module._parameters["bias"] is not None:
        return None
    return module._parameters["weight"]


def compute_dtype(tensor: torch.Tensor) -> torch.dtype:
    """The dtype `F.linear` computes in here: autocast's when it is on for this device, else the tensor's."""
    if torch.is_autocast_enabled(tensor.device.type):
        return torch.get_autocast_dtype(tensor.device.type)
    return tensor.dtype


def token_major(values: torch.Tensor) -> torch.Tensor:
    """[B, H, T, D] values as the [B·T, H·D] matrix a projection writes (a view when laid out that way)."""
    return values.transpose(1, 2).reshape(-1, values.shape[1] * values.shape[3])


def heads_view(matrix: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """A token-major [B·T, H·D] matrix (or its elements in any contiguous shape) seen as [B, H, T, D] values shaped
    like `like`: the inverse of `token_major`."""
    batch, heads, length, dim = like.shape
    return matrix.view(batch, length, heads, dim).transpose(1, 2)


def own_values(v_proj: nn.Module, hidden_states: torch.Tensor, head_dim: int) -> torch.Tensor:
    """`v_proj(h)` as [B, H_kv, T, D], as Llama computes it (a plain `nn.Linear` as its `F.linear`)."""
    weight = plain_linear_weight(v_proj)
    raw = v_proj(hidden_states) if weight is None else F.linear(hidden_states, weight)
    return raw.view(*hidden_states.shape[:-1], -1, head_dim).transpose(1, 2)


def flat_values(v_proj: nn.Module, hidden_states: torch.Tensor, head_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """v_proj's output as the [B·T, H_kv·D] matrix its GEMM writes, and that matrix seen as [B, T, H_kv, D]: a plain
    `nn.Linear` runs as its GEMM on the [B·T, hidden] matrix (one op fewer than its linear); others are called."""
    shape = hidden_states.shape
    weight = plain_linear_weight(v_proj)
    if weight is not None:
        flat = F.linear(hidden_states.reshape(-1, shape[-1]), weight)
    else:
        out = v_proj(hidden_states)
        flat = out.reshape(-1, out.shape[-1])
    return flat, flat.view(*shape[:-1], -1, head_dim)
