"""How a study trains: model sizes and seeded construction, the budget (AdamW, warmup, cosine decay), the training loop
and the validation loss. One loop for every study, so a curve means the same thing in every table."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
from transformers import get_cosine_with_min_lr_schedule_with_warmup

from resformer_hf import cache_nbytes
from resformer_hf.remote_code._compat import cache_of

from benchmarks.common import build_model
from benchmarks.studies.data import Data

# ---- models --------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ModelSize:
    hidden_size: int
    layers: int
    heads: int
    kv_heads: int | None = None  # None: multi-head attention
    intermediate_size: int | None = None  # None: 8/3 of hidden, a multiple of 32
    cross_layer_attention: int | None = None  # ResFormer configs only: layers per group sharing K and V (CLA)
    value_embeddings: str | tuple[int, ...] | None = None  # ResFormer configs only: layers with a value embedding

    @property
    def intermediate(self) -> int:
        return self.intermediate_size or max(32, round(self.hidden_size * 8 / 3 / 32) * 32)

    def describe(self) -> str:
        kv = "" if self.kv_heads in (None, self.heads) else f" ({self.kv_heads} kv)"
        cla = f", CLA{self.cross_layer_attention}" if (self.cross_layer_attention or 1) > 1 else ""
        ve = f", value embeddings {self.value_embeddings}" if self.value_embeddings else ""
        return (f"hidden {self.hidden_size}, {self.layers} layers, {self.heads} heads{kv}{cla}{ve}, "
                f"MLP {self.intermediate}")

    def fields(self, data: Data, seq_len: int) -> dict:
        """Keyword arguments of `common.build_model` for this size and the data's tokenizer."""
        tokenizer = data.tokenizer
        cla = {"cross_layer_attention": self.cross_layer_attention} if self.cross_layer_attention else {}
        if self.value_embeddings:
            value = self.value_embeddings
            cla["value_embeddings"] = value if isinstance(value, str) else list(value)
        return cla | dict(
            vocab_size=data.vocab_size, hidden_size=self.hidden_size, intermediate_size=self.intermediate,
            num_hidden_layers=self.layers, num_attention_heads=self.heads,
            num_key_value_heads=self.kv_heads or self.heads, max_position_embeddings=seq_len, tie_word_embeddings=True,
            pad_token_id=tokenizer.pad_token_id, bos_token_id=tokenizer.bos_token_id,
            eos_token_id=tokenizer.eos_token_id,
        )


def seeded_model(variant: str, size: ModelSize, data: Data, seq_len: int, seed: int, device: torch.device):
    """`common.build_model` after `torch.manual_seed(seed)`: the same seed gives every variant the same draw order."""
    torch.manual_seed(seed)
    return build_model(variant, device, **size.fields(data, seq_len))


def non_embedding_parameters(model) -> int:
    """Parameters outside the (tied) token embedding and LM head, the paper's and scaling laws' model size."""
    embedding = model.get_input_embeddings().weight
    head = model.get_output_embeddings().weight
    skip = {id(embedding), id(head)}
    return sum(p.numel() for p in model.parameters() if id(p) not in skip)


@torch.no_grad()
def cache_bytes_per_token(model, block: torch.Tensor) -> float:
    """`cache_nbytes` of the cache a forward pass over one block builds, per token of the block."""
    past = cache_of(model(input_ids=block[None], use_cache=True))
    return cache_nbytes(past) / block.numel()


# ---- training ------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Budget:
    """How a model is trained: tokens, batch, AdamW with warmup and cosine decay, and how often validation runs."""

    tokens: int
    batch_size: int = 16
    seq_len: int = 128
    lr: float = 3e-3
    warmup: float = 0.05
    weight_decay: float = 0.1
    eval_every: int = 50
    min_lr_rate: float = 0.1

    @property
    def steps(self) -> int:
        return max(1, self.tokens // (self.batch_size * self.seq_len))

    @property
    def tokens_per_step(self) -> int:
        return self.batch_size * self.seq_len

    def describe(self) -> str:
        return (f"{self.steps} AdamW steps × {self.batch_size} sequences of {self.seq_len} tokens = "
                f"{self.steps * self.tokens_per_step / 1e6:.2f}M tokens, lr {self.lr:g} (warmup {self.warmup:.0%}, "
                f"cosine to {self.min_lr_rate:.0%}), weight decay {self.weight_decay:g}, validation every "
                f"{self.eval_every} steps")


@torch.no_grad()
def validation_loss(model, val: torch.Tensor, batch_size: int, device: torch.device) -> float:
    """Token-weighted mean next-token loss over every held-out block."""
    was_training = model.training
    model.eval()
    total, count = 0.0, 0
    for start in range(0, len(val), batch_size):
        batch = val[start : start + batch_size].to(device)
        loss = model(input_ids=batch, labels=batch, use_cache=False).loss
        tokens = batch.numel() - batch.shape[0]
        total += float(loss) * tokens
        count += tokens
    model.train(was_training)
    return total / count


def lambda_parameters(model) -> list[torch.nn.Parameter]:
    """The learnable λ of a ResFormer (the `value_residual` module); none for a Llama."""
    module = getattr(model.base_model, "value_residual", None)
    return list(module.parameters()) if module is not None else []


def parameter_groups(model, weight_decay: float, lr: float, lambda_lr_scale: float = 1.0) -> list[dict]:
    """Decay matrices only; norm gains and the λ (stored as offsets from their initial values) stay undecayed.

    `lambda_lr_scale` gives the λ their own learning rate (`lr × scale`): AdamW moves a parameter by about its
    learning rate per step whatever its gradient, so O(1) λ need O(1 / lr) steps to move by O(1).
    """
    special = {id(p) for p in lambda_parameters(model)} if lambda_lr_scale != 1.0 else set()
    trainable = [p for p in model.parameters() if p.requires_grad and id(p) not in special]
    groups = [
        {"params": [p for p in trainable if p.ndim >= 2], "weight_decay": weight_decay, "lr": lr},
        {"params": [p for p in trainable if p.ndim < 2], "weight_decay": 0.0, "lr": lr},
    ]
    if special:
        groups.append({"params": lambda_parameters(model), "weight_decay": 0.0, "lr": lr * lambda_lr_scale})
    return groups


def optimizer_and_schedule(model, budget: Budget, steps: int, lambda_lr_scale: float = 1.0, *,
                            fused: bool = False) -> tuple[torch.optim.AdamW, torch.optim.lr_scheduler.LambdaLR]:
    """AdamW (β 0.9, 0.95) over `parameter_groups`, and its schedule: linear warmup over `budget.warmup` of `steps`,
    then cosine decay to `budget.min_lr_rate` of the peak. `fused`: the fused kernel (a GPU's choice)."""
    groups = parameter_groups(model, budget.weight_decay, budget.lr, lambda_lr_scale)
    optimizer = torch.optim.AdamW(groups, lr=budget.lr, betas=(0.9, 0.95), fused=fused or None)
    scheduler = get_cosine_with_min_lr_schedule_with_warmup(
        optimizer, num_warmup_steps=max(1, int(budget.warmup * steps)), num_training_steps=steps,
        min_lr_rate=budget.min_lr_rate,
    )
    return optimizer, scheduler


def train(model, data: Data, budget: Budget, order: torch.Tensor, device: torch.device, *, label: str = "",
          probe: Callable[[object], object] | None = None, lambda_lr_scale: float = 1.0) -> dict:
    """Train `model` on `data.train[order[step]]` for `len(order)` steps and return its validation curve.

    Returns `curve` ([(training tokens, validation loss)], starting at 0 tokens), `train_curve` ([(training tokens,
    mean and max training loss of the steps since the previous evaluation)], where loss spikes show), `train_seconds`
    (optimizer steps only, evaluation excluded) and, with `probe`, `probes`: `probe(model)` at every evaluation.
    """
    model.to(device).train()
    steps = len(order)
    optimizer, scheduler = optimizer_and_schedule(model, budget, steps, lambda_lr_scale)
    eval_batch = budget.batch_size * 2
    curve = [(0, validation_loss(model, data.val, eval_batch, device))]
    probes = [probe(model)] if probe else []
    recent: list[float] = []
    train_curve = []
    seconds = 0.0
    for step in range(1, steps + 1):
        start = time.perf_counter()
        batch = data.train[order[step - 1]].to(device)
        loss = model(input_ids=batch, labels=batch, use_cache=False).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        recent.append(float(loss.detach()))
        seconds += time.perf_counter() - start
        if step % budget.eval_every == 0 or step == steps:
            curve.append((step * budget.tokens_per_step, validation_loss(model, data.val, eval_batch, device)))
            train_curve.append((step * budget.tokens_per_step, sum(recent) / len(recent), max(recent)))
            if probe:
                probes.append(probe(model))
            print(f"  {label:>28} step {step:5d}/{steps}  train {sum(recent) / len(recent):.4f}  "
                  f"val {curve[-1][1]:.4f}  {seconds:.0f}s", flush=True)
            recent.clear()
    model.eval()
    result = {"curve": curve, "train_curve": train_curve, "final_val_loss": curve[-1][1], "train_seconds": seconds}
    if probe:
        result["probes"] = probes
    return result
