"""An independent plain-torch ResFormer forward pass, written from the paper's equations, with the baselines it
is compared with: DenseFormer's depth-weighted averages (Pagliardini et al., 2024) and cross-layer attention (CLA,
Brandon et al., 2024), and value embeddings (modded-nanogpt, nanochat): `V'' = V' + 2·σ(x̂[..., :12] W_gᵀ)·E[token]`
per kv head in the layers that have a table.

It reads only the state dict and the config fields, never the package's modules, so agreement with
`ResFormerForCausalLM` checks the implementation rather than restating it.
"""

from __future__ import annotations

import math

import torch


def effective_weights(config, state: dict[str, torch.Tensor]) -> dict[int, dict[int, float | torch.Tensor]]:
    """For each receiving layer n: {source layer j: weight on V_j} (j == n is the layer's own value).

    Learnable weights stay tensors computed from the state dict, so gradients reach λ through the reference too."""
    variant = config.value_residual
    L = config.num_hidden_layers
    if variant in ("none", "denseformer"):
        return {}
    if config.value_residual_layers is not None:
        receivers = sorted(config.value_residual_layers)
    elif variant == "sparse":
        receivers = list(range(L - math.ceil(3 * L / 8), L))
    else:
        receivers = list(range(1, L))
    defaults = {
        "identity": (0.5, 0.5), "constant": (2.0, 1.0), "learnable": (0.5, 0.5), "learnable_plus": (None, 0.5),
        "sparse": (5.0, 1.0), "dense": (0.5, 0.5), "neutreno": (0.4, None), "svformer": (1.0, 0.0),
        "gated": (0.5, None),
    }
    first0, self0 = defaults[variant]
    if config.value_residual_lambda_first is not None:
        first0 = config.value_residual_lambda_first
    if config.value_residual_lambda_self is not None:
        self0 = config.value_residual_lambda_self
    prefix = "model.value_residual."
    out: dict[int, dict[int, float | torch.Tensor]] = {}
    if variant == "learnable":
        f = first0 + state[prefix + "lambda_first_offset"]
        s = self0 + state[prefix + "lambda_self_offset"]
        for r, n in enumerate(receivers):
            out[n] = {0: f[r], n: s[r]}
    elif variant == "learnable_plus":
        scale = (config.value_residual_lambda_scale or L) + state[prefix + "lambda_scale_offset"].reshape(-1)[0]
        logits = state[prefix + "lambda_logits"].double()
        probs = torch.exp(logits) / torch.exp(logits).sum()
        s = self0 + state[prefix + "lambda_self_offset"]
        for r, n in enumerate(receivers):
            out[n] = {0: scale * probs[r], n: s[r]}
    elif variant == "dense":
        offsets = state[prefix + "dense_weight_offset"]
        for r, n in enumerate(receivers):
            weights = {j: offsets[r, j] for j in range(n + 1)}
            weights[0] = weights[0] + first0
            weights[n] = weights[n] + self0
            out[n] = weights
    elif variant == "neutreno":
        lam = 0.4 if config.neutreno_lambda is None else config.neutreno_lambda
        for n in receivers:
            out[n] = {0: lam}
    elif variant == "svformer":
        for n in range(1, L):
            out[n] = {0: 1.0}
    elif variant == "gated":  # the initial mix g0 on V_0; the mix itself depends on the token (`gated_values`)
        for n in receivers:
            out[n] = {0: first0, n: 1.0 - first0}
    else:  # identity, constant, sparse: fixed
        for n in receivers:
            out[n] = {0: first0, n: self0}
    return out


def _scaled(coef, values: torch.Tensor) -> torch.Tensor:
    return (coef.to(values.dtype) if torch.is_tensor(coef) else coef) * values


def rms_norm(x, weight, eps):
    x32 = x.float()
    return weight * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def rope(x, positions, theta):
    d = x.shape[-1]
    inv = 1.0 / (theta ** (torch.arange(0, d, 2, dtype=torch.float32) / d))
    ang = positions[:, None].float() * inv[None, :]
    cos, sin = torch.cat([ang.cos(), ang.cos()], -1), torch.cat([ang.sin(), ang.sin()], -1)
    x1, x2 = x[..., : d // 2], x[..., d // 2:]
    return x * cos + torch.cat([-x2, x1], -1) * sin


def reference_logits(config, state: dict[str, torch.Tensor], input_ids: torch.Tensor) -> torch.Tensor:
    """Causal-LM logits [B, T, V] of a ResFormer with these weights, in plain torch (no cache, no padding)."""
    B, T = input_ids.shape
    H, Hkv = config.num_attention_heads, config.num_key_value_heads
    D = config.hidden_size // H
    eps = config.rms_norm_eps
    theta = config.rope_parameters["rope_theta"]
    weights = effective_weights(config, state)
    tables = value_embedding_layers(config)
    positions = torch.arange(T)
    causal = torch.full((T, T), float("-inf")).triu(1)

    x = state["model.embed_tokens.weight"][input_ids]
    raw_values: list[torch.Tensor] = []
    block_outputs = [x]  # DenseFormer: X_0 (the embeddings), X_1, ... (each block's output)
    group = config.cross_layer_attention or 1  # CLA: layer n attends over the K, V of layer n - n % group
    shared: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
    for n in range(config.num_hidden_layers):
        p = f"model.layers.{n}."
        h = rms_norm(x, state[p + "input_layernorm.weight"], eps)
        q = _linear(h, state, p + "self_attn.q_proj").view(B, T, H, D).transpose(1, 2)
        if n % group:
            raw_values.append(raw_values[-1])
            k, v = shared[n - n % group]
            attn = _attention(rope(q, positions, theta), k, v, H // Hkv, causal)
            x = _finish_block(x, attn, state, p, eps, B, T, H * D)
            x = _depth_average(config, state, block_outputs, x)
            continue
        k = _linear(h, state, p + "self_attn.k_proj").view(B, T, Hkv, D).transpose(1, 2)
        if config.value_residual == "svformer" and n > 0:
            v_own = raw_values[0]
        else:
            v_own = _linear(h, state, p + "self_attn.v_proj").view(B, T, Hkv, D).transpose(1, 2)
        raw_values.append(v_own)
        v = v_own
        w = weights.get(n)
        if w is not None and config.value_residual == "gated":
            v = gated_values(state, p, h, w[0], raw_values[0], v_own)
        elif w is not None and config.value_residual not in ("neutreno", "svformer"):
            v = sum(_scaled(coef, raw_values[j]) for j, coef in w.items())
        if n in tables:  # after the mix, on what the layer attends over and caches; V_0 above stays v_proj's
            v = v + value_embedding(state, p, h, input_ids, B, T, Hkv, D)
        q, k = rope(q, positions, theta), rope(k, positions, theta)
        shared[n] = (k, v)
        attn = _attention(q, k, v, H // Hkv, causal)
        if w is not None and config.value_residual == "neutreno":
            attn = attn + _scaled(w[0], (raw_values[0] - v_own).repeat_interleave(H // Hkv, dim=1))
        x = _finish_block(x, attn, state, p, eps, B, T, H * D)
        x = _depth_average(config, state, block_outputs, x)
    x = rms_norm(x, state["model.norm.weight"], eps)
    head = state.get("lm_head.weight", state["model.embed_tokens.weight"])
    return x @ head.T


def gated_values(state, p: str, h, initial_mix: float, first, own) -> torch.Tensor:
    """`(1 − g)·V_n + g·V_0` with `g = g0 − 1/2 + σ(h[..., :12] W_gᵀ + b_g)`: one mix per token and kv head, from the
    first 12 channels of the layer's normalised input h [B, T, hidden] (nanochat's gate input); V_0 and V_n are
    [B, H_kv, T, D]."""
    weight = state[p + "self_attn.value_gate.weight"]
    logits = h[..., :12] @ weight.T + state[p + "self_attn.value_gate.bias"]  # [B, T, H_kv]
    g = (initial_mix - 0.5 + 1.0 / (1.0 + torch.exp(-logits))).transpose(1, 2).unsqueeze(-1)  # [B, H_kv, T, 1]
    return (1 - g) * own + g * first


def _linear(x, state, name: str) -> torch.Tensor:
    """x Wᵀ + b, the bias where the state dict has one (`attention_bias=True`)."""
    out = x @ state[name + ".weight"].T
    return out if name + ".bias" not in state else out + state[name + ".bias"]


def value_embedding_layers(config) -> list[int]:
    """Layers with a table: the listed ones, `"u_net"` = {1, 2, L−3, L−2, L−1} within 1..L−1 (modded-nanogpt's 11-layer
    layout 1, 2, 8, 9, 10), `"alternating"` = those an even distance below the last layer (nanochat's `has_ve`)."""
    chosen, L = getattr(config, "value_embeddings", None), config.num_hidden_layers
    if not chosen:
        return []
    if chosen == "alternating":
        return [n for n in range(L) if (L - 1 - n) % 2 == 0]
    if chosen == "u_net":
        return sorted({n for n in (1, 2, L - 3, L - 2, L - 1) if 1 <= n < L})
    return sorted(chosen)


def value_embedding(state, p: str, h, input_ids, B: int, T: int, Hkv: int, D: int) -> torch.Tensor:
    """`g·E[token]` [B, H_kv, T, D]: the layer's table row of each token (columns: kv head by kv head), times its gate
    `g = 2·σ(h[..., :12] W_gᵀ)` per token and kv head, h the layer's normalised input."""
    weight = state[p + "self_attn.value_embedding_gate.weight"]  # [H_kv, channels]
    g = 2.0 / (1.0 + torch.exp(-(h[..., : weight.shape[1]] @ weight.T)))  # [B, T, H_kv]
    rows = state[p + "self_attn.value_embedding.weight"][input_ids].view(B, T, Hkv, D)
    return (g.unsqueeze(-1) * rows).transpose(1, 2)


def _attention(q, k, v, groups: int, causal: torch.Tensor) -> torch.Tensor:
    """softmax(q kᵀ/√D + causal) v with the kv heads repeated for grouped-query attention; [B, H, T, D]."""
    k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    return torch.softmax(q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1]) + causal, dim=-1) @ v


def _finish_block(x, attn, state, p: str, eps: float, B: int, T: int, width: int) -> torch.Tensor:
    """The rest of a pre-norm Llama block after attention: o_proj, residual, RMSNorm, SwiGLU MLP, residual."""
    x = x + _linear(attn.transpose(1, 2).reshape(B, T, width), state, p + "self_attn.o_proj")
    h = rms_norm(x, state[p + "post_attention_layernorm.weight"], eps)
    gate = h @ state[p + "mlp.gate_proj.weight"].T
    up = h @ state[p + "mlp.up_proj.weight"].T
    return x + (torch.nn.functional.silu(gate) * up) @ state[p + "mlp.down_proj.weight"].T


def _depth_average(config, state, block_outputs: list[torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    """DenseFormer: after block i, Σ_j α[i, j]·X_j over X_0 .. X_i with (i − j) divisible by the dilation, where α is
    1 on X_i and 0 elsewhere plus the stored offsets; other variants: X_i unchanged."""
    block_outputs.append(x)
    if config.value_residual != "denseformer":
        return x
    i, dilation = len(block_outputs) - 1, config.denseformer_dilation or 1
    offsets = state["model.depth_weighted_average.weight_offset"][i - 1]
    return sum((float(j == i) + offsets[j]) * block_outputs[j] for j in range(i + 1) if (i - j) % dilation == 0)
