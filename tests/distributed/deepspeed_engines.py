"""Worker: DeepSpeed ZeRO on 2 CPU processes (`DS_ACCELERATOR=cpu torchrun --nproc_per_node 2`, gloo).

ZeRO-2 and ZeRO-3 through `deepspeed.initialize` (ZeRO-3 with `HfDeepSpeedConfig`, so `from_pretrained` partitions
the model while it loads), ZeRO-3 through `Trainer(args=TrainingArguments(deepspeed=...))`, and bf16 (which dtype
the λ are mixed in). Usage: `torchrun --nproc_per_node 2 deepspeed_engines.py DATA_DIR OUT.json`.
"""

from __future__ import annotations

import os
import sys
import tempfile
from datetime import timedelta
from functools import partial
from pathlib import Path

import deepspeed
import torch
import torch.distributed as dist
from accelerate import PartialState
from accelerate.state import AcceleratorState
from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_grad
from transformers import AutoModelForCausalLM, Trainer, TrainingArguments
from transformers.integrations import HfDeepSpeedConfig

import resformer_hf  # noqa: F401  (registers the Auto classes)

from engine_common import (
    LEARNING_RATE,
    STEPS,
    DataParallel,
    check_every_model,
    lambda_parameters,
    lambda_table,
    lambdas_seen_in_forward,
    train,
)

MICRO_BATCH = 2
#: The ZeRO-3 config of docs/scaling-out.md's Trainer recipe ("auto": filled in from `TrainingArguments`).
TRAINER_ZERO3_CONFIG = {
    "zero_optimization": {"stage": 3},
    "train_micro_batch_size_per_gpu": "auto",
    "gradient_accumulation_steps": "auto",
    "gradient_clipping": "auto",
    "bf16": {"enabled": "auto"},
}


def deepspeed_config(stage: int, bf16: bool = False) -> dict:
    return {
        "train_micro_batch_size_per_gpu": MICRO_BATCH,
        "gradient_accumulation_steps": 1,
        "zero_optimization": {"stage": stage},
        "bf16": {"enabled": bf16},
        "gradient_clipping": 0.0,  # DeepSpeed clips to norm 1.0 unless told otherwise; the reference does not clip
        "zero_allow_untested_optimizer": True,
    }


class ZeRO(DataParallel):
    """`deepspeed.initialize` with the reference's torch AdamW, which DeepSpeed wraps."""

    def __init__(self, model, config: dict):
        super().__init__(model)
        self.engine, *_ = deepspeed.initialize(model=model, optimizer=self.optimizer, config=config)
        self.model = self.engine.module

    def forward(self, input_ids):
        return self.engine(input_ids=input_ids, labels=input_ids).loss

    def backward(self, loss):
        self.engine.backward(loss)

    def step(self):
        self.engine.step()

    def full(self, parameter):
        return safe_get_full_fp32_param(parameter)

    def full_grad(self, parameter):
        return safe_get_full_grad(parameter)


def load(path: Path, config: dict) -> tuple[torch.nn.Module, HfDeepSpeedConfig]:
    """`from_pretrained` as DeepSpeed users do it. transformers holds only a weak reference to the `HfDeepSpeedConfig`
    (under ZeRO-3 it makes `from_pretrained` load into partitions), so it is returned for the caller to keep."""
    deepspeed_settings = HfDeepSpeedConfig(config)
    dtype = torch.bfloat16 if config["bf16"]["enabled"] else torch.float32
    return AutoModelForCausalLM.from_pretrained(path, dtype=dtype), deepspeed_settings


def zero(path: Path, batch: torch.Tensor, stage: int) -> dict:
    model, _settings = load(path, deepspeed_config(stage))
    return train(ZeRO(model, deepspeed_config(stage)), batch)


def deepspeed_state_on_cpu() -> None:
    """Make accelerate (which the Trainer runs on) use DeepSpeed over gloo on CPU.

    Without a GPU, accelerate 1.x gives `TrainingArguments(deepspeed=...)` no backend, so each process trains as if
    it were alone (world size 1, the whole dataset, while the DeepSpeed engine still averages gradients between
    them), and `use_cpu=True` switches DeepSpeed off. A GPU machine needs none of this; the Trainer code is the same.
    """
    os.environ["ACCELERATE_USE_DEEPSPEED"] = "true"
    PartialState(backend="gloo")


def trainer_zero3(path: Path, batch: torch.Tensor) -> dict:
    """The stock Trainer with a ZeRO-3 config: per-step losses (averaged over ranks), λ and λ table after."""
    with tempfile.TemporaryDirectory() as output_dir:
        arguments = TrainingArguments(
            output_dir=output_dir, deepspeed=TRAINER_ZERO3_CONFIG,
            per_device_train_batch_size=MICRO_BATCH, learning_rate=LEARNING_RATE, weight_decay=0.0,
            max_grad_norm=0.0,  # no clipping, as the reference
            lr_scheduler_type="constant", max_steps=STEPS, logging_steps=1, save_strategy="no", report_to="none",
            seed=0, disable_tqdm=True, dataloader_num_workers=0, accelerator_config={"use_configured_state": True},
        )
        assert arguments.world_size == dist.get_world_size()
        model = AutoModelForCausalLM.from_pretrained(path)  # after TrainingArguments: partitioned while loading
        dataset = [{"input_ids": row, "labels": row} for row in batch]
        trainer = Trainer(model=model, args=arguments, train_dataset=dataset)
        trainer.train()
        model = trainer.model_wrapped.module
        AcceleratorState._reset_state()  # the next Trainer brings its own DeepSpeed plugin; keep the process state
        return {
            "losses": [entry["loss"] for entry in trainer.state.log_history if "loss" in entry],
            "lambdas": {
                name: safe_get_full_fp32_param(parameter).flatten().tolist()
                for name, parameter in lambda_parameters(model).items()
            },
            "table_after": lambda_table(model),
        }


def mixing_weights_in_bf16(path: Path, batch: torch.Tensor, stage: int) -> dict:
    """The λ table the layers received in one bf16 forward pass, and the λ table, under ZeRO `stage`."""
    config = deepspeed_config(stage, bf16=True)
    model, _settings = load(path, config)
    engine = ZeRO(model, config)
    module = engine.model.model.value_residual
    table, per_layer = lambdas_seen_in_forward(module, lambda: engine.engine(input_ids=engine.local_batch(batch)))
    return {
        "dtype": None if table is None else str(table.dtype),
        "weights": None if table is None else table.float().tolist(),
        "per_layer": per_layer,
        "parameter_dtypes": sorted({str(p.dtype) for p in lambda_parameters(engine.model).values()}),
        "buffer_dtypes": sorted({str(b.dtype) for b in module.buffers()}),
        "table_before": lambda_table(engine.model),
    }


def main(data_dir: str, out: str) -> None:
    deepspeed.init_distributed(dist_backend="gloo", timeout=timedelta(seconds=60))
    deepspeed_state_on_cpu()
    checks = {"zero2": partial(zero, stage=2), "zero3": partial(zero, stage=3), "trainer_zero3": trainer_zero3}
    mixing_checks = {
        "zero2_bf16": partial(mixing_weights_in_bf16, stage=2),
        "zero3_bf16": partial(mixing_weights_in_bf16, stage=3),
    }
    check_every_model(data_dir, out, checks, mixing_checks)
    dist.barrier()


if __name__ == "__main__":
    main(*sys.argv[1:3])
