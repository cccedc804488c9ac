"""Part `pretrain` of the GPU run: Llama and ResFormer `learnable_plus` pre-trained from the same initial
weights on the same batches at the paper's smallest scale, and the paper's metric read off their validation curves.

Model: hidden 768, 8 layers, 12 heads, MLP 2048, a 32,768-token byte-level BPE with tied embeddings: 81.8M parameters
(56.6M outside the embedding), the paper's smallest model (82M). Context 2048, 32 sequences (65,536 tokens) a step,
1,526 AdamW steps: 100.0M training tokens per arm; peak learning rate 1e-3 (warmup 5%, cosine to 10%), weight decay
0.1, gradients clipped at 1.0; float32 weights under bf16 autocast, SDPA, fused AdamW, `torch.compile` (inductor);
validation every 64 steps (4.2M tokens) on 256 held-out blocks (0.52M tokens). Text: `pretrain_data.py` (the
machine's own Python installation, split by file, its digest recorded).

Arms are `VARIANT[@SEED]` (`--arms`, default `llama learnable_plus`; add `svformer` or `llama@1` where time allows).
The seed draws the initial weights and the batch order; every other arm copies the same seed's Llama's initial weights
for each parameter they share (SVFormer has no value projections after layer 0), so the arms of a seed start equal and
see the same batches. The arms train in lockstep, one step each in turn, so a run stopped anywhere leaves them at the
same number of tokens, on the same point of the learning-rate schedule.

It keeps to `--seconds`: before each step it checks that the step, an evaluation and a checkpoint still fit, and if
not (or after `--pause-after` steps, which rehearses it) saves every arm's model, optimiser, schedule and curve in
`--work` (default `.pretrain-work/`, which a warm device machine keeps between calls) and stops; the same command
continues from there. Every evaluation is a JSON line in `OUT/gpu.jsonl` as it is measured; an arm that finishes
writes `pretrain/final/ARM` with its whole curve and the identity it is stored under (`benchmarks/gpu/__main__.py`
says how to run it and how `--report` stores and reports it).
"""

from __future__ import annotations

import hashlib
import math
import os
import sysconfig
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from resformer_hf import VALUE_RESIDUAL_VARIANTS
from resformer_hf.analysis import lambda_table

from . import pretrain_data
from benchmarks.common import BASELINE
from benchmarks.studies.data import Data, batch_order
from benchmarks.studies.plan import RUN_CODE, budget_identity, device_kind, model_identity
from benchmarks.studies.training import (
    Budget,
    ModelSize,
    non_embedding_parameters,
    optimizer_and_schedule,
    seeded_model,
    validation_loss,
)

PART = "pretrain"


@dataclass(frozen=True)
class Scale:
    """The model, data and budget of one size of the comparison."""

    size: ModelSize
    vocab_size: int
    seq_len: int
    batch_size: int
    tokens: int  #: at least this many training tokens per arm (whole steps)
    eval_every: int  #: steps
    val_tokens: int
    lr: float
    tokenizer_chars: int  #: the tokenizer is trained on this much of the training split
    held_out: float  #: share of the files held out for validation
    backend: str  #: torch.compile backend

    def budget(self, tokens: int | None = None) -> Budget:
        per_step = self.batch_size * self.seq_len
        steps = math.ceil((tokens or self.tokens) / per_step)
        return Budget(tokens=steps * per_step, batch_size=self.batch_size, seq_len=self.seq_len, lr=self.lr,
                      warmup=0.05, weight_decay=0.1, eval_every=self.eval_every)


PAPER = Scale(ModelSize(768, 8, 12, None, 2048), vocab_size=32768, seq_len=2048, batch_size=32, tokens=100_000_000,
              eval_every=64, val_tokens=256 * 2048, lr=1e-3, tokenizer_chars=32_000_000, held_out=1 / 64,
              backend="inductor")
#: `--smoke`: toy size on the CPU, on a few packages of the standard library (`SMOKE_FOLDERS`).
SMOKE = Scale(ModelSize(64, 2, 4, None, 128), vocab_size=512, seq_len=64, batch_size=8, tokens=12_288, eval_every=8,
              val_tokens=4096, lr=3e-3, tokenizer_chars=400_000, held_out=0.1, backend="aot_eager")
SMOKE_FOLDERS = ("json", "email", "http", "logging", "urllib", "xml", "importlib", "html")
#: Seconds a checkpoint of every arm is allowed for in the deadline (about 2 GB for two arms at the paper's scale).
CHECKPOINT_S = {"cuda": 20.0, "cpu": 2.0}


@dataclass(frozen=True)
class Options:
    """The part's command-line options."""

    arms: tuple[str, ...] = (BASELINE, "learnable_plus")
    tokens: int | None = None  #: training tokens per arm (default: the scale's)
    work: Path = Path(".pretrain-work")
    pause_after: int | None = None  #: checkpoint and stop after this many steps of this call


def parse_arm(text: str) -> tuple[str, int]:
    """`VARIANT[@SEED]` → (variant, seed)."""
    variant, _, seed = text.partition("@")
    if variant != BASELINE and variant not in VALUE_RESIDUAL_VARIANTS:
        raise SystemExit(f"--arms: unknown model {variant!r}; choose {BASELINE} or a value_residual variant "
                         f"({', '.join(VALUE_RESIDUAL_VARIANTS)}), optionally @SEED")
    try:
        return variant, int(seed or 0)
    except ValueError:
        raise SystemExit(f"--arms: {text!r} is not VARIANT@SEED with a whole-number seed") from None


def tensor_digest(tensors: list[tuple[str, torch.Tensor]]) -> str:
    digest = hashlib.sha256()
    for name, tensor in tensors:
        digest.update(name.encode())
        digest.update(tensor.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()[:16]


def initial_models(arms: list[tuple[str, int]], scale: Scale, data: Data) -> dict[str, torch.nn.Module]:
    """Each arm's model, seeded; a non-Llama arm takes the same seed's Llama's weights for every parameter they
    share, so all arms of a seed start from one draw."""
    llamas, models = {}, {}
    for variant, seed in arms:
        if seed not in llamas:
            llamas[seed] = seeded_model(BASELINE, scale.size, data, scale.seq_len, seed, torch.device("cpu"))
        model = seeded_model(variant, scale.size, data, scale.seq_len, seed, torch.device("cpu"))
        reference, own = llamas[seed].state_dict(), model.state_dict()
        model.load_state_dict({name: value for name, value in reference.items()
                               if name in own and own[name].shape == value.shape}, strict=False)
        models[f"{variant}@{seed}"] = model
    return models


class Trainee:
    """One arm: its model (compiled for training, eager for validation), AdamW and schedule, batch order and curve."""

    def __init__(self, key: str, model, data: Data, budget: Budget, scale: Scale, device: torch.device):
        self.key, self.device, self.budget = key, device, budget
        self.variant, self.seed = parse_arm(key)
        self.model = model.to(device).train()
        self.optimizer, self.scheduler = optimizer_and_schedule(model, budget, budget.steps,
                                                                fused=device.type == "cuda")
        self.order = batch_order(len(data.train), budget.batch_size, budget.steps, self.seed).to(device)
        self.forward = torch.compile(self.model, backend=scale.backend)
        self.curve, self.train_curve, self.recent = [], [], []
        self.seconds, self.timed_steps, self.first_steps, self.events = 0.0, 0, [], []

    def step(self, step: int, data: Data, timed: bool = True) -> None:
        on_gpu = self.device.type == "cuda"
        if timed and on_gpu:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
        began = time.perf_counter()
        batch = data.train[self.order[step - 1]]
        with torch.autocast(self.device.type, dtype=torch.bfloat16):
            loss = self.forward(input_ids=batch, labels=batch, use_cache=False).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.recent.append(loss.detach())
        if timed:
            self.timed_steps += 1
            if on_gpu:
                end.record()
                self.events.append((start, end))
            else:
                self.seconds += time.perf_counter() - began

    def settle(self) -> None:
        """Add the device time of the steps run since the last call (the device must be synchronised)."""
        self.seconds += sum(start.elapsed_time(end) for start, end in self.events) / 1000
        self.events.clear()

    @property
    def tokens_per_s(self) -> float | None:
        return self.timed_steps * self.budget.tokens_per_step / self.seconds if self.seconds else None

    def evaluate(self, data: Data, step: int) -> dict:
        with torch.autocast(self.device.type, dtype=torch.bfloat16):
            loss = validation_loss(self.model, data.val, self.budget.batch_size, self.device)
        tokens = step * self.budget.tokens_per_step
        self.curve.append((tokens, loss))
        point = {"step": step, "tokens": tokens, "val_loss": loss, "lr": self.scheduler.get_last_lr()[0]}
        if self.recent:
            losses = torch.stack(self.recent).float()
            self.train_curve.append((tokens, float(losses.mean()), float(losses.max())))
            point.update(train_loss=self.train_curve[-1][1], train_loss_max=self.train_curve[-1][2])
            self.recent.clear()
        return point | {"train_seconds": round(self.seconds, 2), "tokens_per_s": self.tokens_per_s}

    def state(self) -> dict:
        return {"model": self.model.state_dict(), "optimizer": self.optimizer.state_dict(),
                "scheduler": self.scheduler.state_dict(), "curve": self.curve, "train_curve": self.train_curve,
                "recent": [float(loss) for loss in self.recent], "seconds": self.seconds,
                "timed_steps": self.timed_steps, "first_steps": self.first_steps}

    def load(self, state: dict) -> None:
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        self.curve, self.train_curve = [tuple(p) for p in state["curve"]], [tuple(p) for p in state["train_curve"]]
        self.recent = [torch.tensor(loss, device=self.device) for loss in state["recent"]]
        self.seconds, self.timed_steps, self.first_steps = state["seconds"], state["timed_steps"], state["first_steps"]


def identity(trainee: Trainee, scale: Scale, facts: dict) -> dict:
    """The run's identity in the store: a from-scratch pre-training run, with the corpus and tokenizer by digest."""
    data = {key: facts[key] for key in ("corpus_digest", "tokenizer_digest", "vocab_size", "held_out", "seq_len",
                                        "val_tokens", "train_tokens")}
    return {"kind": "pretrain", "code": RUN_CODE, "device": device_kind(trainee.device),
            "data": {"corpus": "python-installation", **data}, "model": model_identity(trainee.variant, scale.size),
            "budget": budget_identity(trainee.budget), "seed": trainee.seed, "precision": "bf16-autocast",
            "compile": scale.backend, "init": "same-seed llama"}


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


class Lockstep:
    """The arms trained one step each in turn, evaluated together, checkpointed together."""

    def __init__(self, recorder, schedule, trainees: list[Trainee], data: Data, checkpoint: Path):
        self.recorder, self.schedule, self.trainees, self.data = recorder, schedule, trainees, data
        self.checkpoint, self.device = checkpoint, trainees[0].device
        self.budget = trainees[0].budget
        self.step_s, self.eval_s = 0.0, 0.0  # wall seconds of one lockstep step and of one evaluation, as measured

    def resume(self) -> int:
        """The step a checkpoint of these arms stopped at (0 without one), its state loaded."""
        if not self.checkpoint.is_file():
            return 0
        state = torch.load(self.checkpoint, map_location=self.device, weights_only=False)
        for trainee in self.trainees:
            trainee.load(state["arms"][trainee.key])
        self.recorder.write(PART, "resumed", ok=None, step=state["step"], checkpoint=str(self.checkpoint))
        return state["step"]

    def evaluate(self, step: int) -> None:
        synchronize(self.device)
        began = time.perf_counter()
        for trainee in self.trainees:
            trainee.settle()
            self.recorder.write(PART, f"eval/{trainee.key}", ok=None, **trainee.evaluate(self.data, step))
        self.eval_s = time.perf_counter() - began

    def fits(self) -> bool:
        # the host may have queued a few steps ahead of the device: allow for several
        margin = 8 * self.step_s + self.eval_s + CHECKPOINT_S.get(self.device.type, 20.0)
        return self.schedule.allows(margin)

    def run(self, pause_after: int | None) -> bool:
        """Train to the end of the budget (True) or until the deadline or `pause_after` steps (False, saved)."""
        start = self.resume()
        if start == 0:
            self.evaluate(0)
        steps = self.budget.steps
        for trainee in self.trainees:  # the first step compiles: timed apart, its tokens counted
            if start < steps:
                began = time.perf_counter()
                trainee.step(start + 1, self.data, timed=False)
                synchronize(self.device)
                trainee.first_steps.append(round(time.perf_counter() - began, 1))
                self.recorder.write(PART, f"compiled/{trainee.key}", ok=True, step=start + 1,
                                    first_step_s=trainee.first_steps[-1])
        if start < steps and ((start + 1) % self.budget.eval_every == 0 or start + 1 == steps):
            self.evaluate(start + 1)
        interval_began, interval_steps = time.perf_counter(), 0
        for step in range(start + 2, steps + 1):
            if (pause_after is not None and step - start > pause_after) or not self.fits():
                self.pause(step - 1)
                return False
            for trainee in self.trainees:
                trainee.step(step, self.data)
            interval_steps += 1
            if step % self.budget.eval_every == 0 or step == steps:
                synchronize(self.device)
                self.step_s = (time.perf_counter() - interval_began) / interval_steps
                self.evaluate(step)
                interval_began, interval_steps = time.perf_counter(), 0
        return True

    def pause(self, step: int) -> None:
        synchronize(self.device)
        for trainee in self.trainees:
            trainee.settle()
        began = time.perf_counter()
        staging = self.checkpoint.with_suffix(".tmp")
        torch.save({"step": step, "arms": {t.key: t.state() for t in self.trainees}}, staging)
        os.replace(staging, self.checkpoint)
        self.recorder.write(PART, "paused", ok=None, step=step, tokens=step * self.budget.tokens_per_step,
                            steps=self.budget.steps, checkpoint=str(self.checkpoint),
                            save_s=round(time.perf_counter() - began, 1))


def smoke_roots() -> list[Path]:
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    return [stdlib / name for name in SMOKE_FOLDERS if (stdlib / name).is_dir()]


def run(recorder, schedule, plan) -> None:
    options = plan.pretrain or Options()
    scale, device = (SMOKE if plan.smoke else PAPER), plan.device
    arms = list(dict.fromkeys(parse_arm(text) for text in options.arms))
    budget = scale.budget(options.tokens)
    work = Path(options.work)
    work.mkdir(parents=True, exist_ok=True)
    began = time.perf_counter()
    data, facts = pretrain_data.build(
        smoke_roots() if plan.smoke else pretrain_data.installation_roots(), work, vocab_size=scale.vocab_size,
        held_out=scale.held_out, tokenizer_chars=scale.tokenizer_chars, seq_len=scale.seq_len,
        train_tokens=budget.tokens, val_tokens=scale.val_tokens, manifest=recorder.path.parent / "corpus-files.tsv.gz")
    recorder.write(PART, "data", ok=True, seconds=round(time.perf_counter() - began, 1), **facts)
    models = initial_models(arms, scale, data)
    common = set.intersection(*(set(dict(model.named_parameters())) for model in models.values()))
    described = {key: dict(
        variant=variant, seed=seed, parameters=sum(p.numel() for p in model.parameters()),
        non_embedding_parameters=non_embedding_parameters(model),
        shared_init_digest=tensor_digest(sorted(((n, p) for n, p in model.named_parameters() if n in common),
                                                key=lambda item: item[0])),
        order_digest=tensor_digest([("order", batch_order(len(data.train), budget.batch_size, budget.steps, seed))]),
    ) for (variant, seed), (key, model) in zip(arms, models.items())}
    data = Data(data.tokenizer, data.train.to(device), data.val.to(device))
    trainees = [Trainee(key, model, data, budget, scale, device) for key, model in models.items()]
    run_key = hashlib.sha256(repr([facts["corpus_digest"], facts["tokenizer_digest"], sorted(models),
                                   budget_identity(budget), scale]).encode()).hexdigest()[:16]
    recorder.write(PART, "setup", ok=True, arms=described, size=scale.size.describe(), budget=budget.describe(),
                   steps=budget.steps, tokens_per_step=budget.tokens_per_step, epochs=round(
                       budget.tokens / data.train.numel(), 3), backend=scale.backend, run_key=run_key)
    lockstep = Lockstep(recorder, schedule, trainees, data, work / f"run-{run_key}.pt")
    if not lockstep.run(options.pause_after):
        return
    for trainee in trainees:
        recorder.write(PART, f"final/{trainee.key}", ok=True, complete=True, identity=identity(trainee, scale, facts),
                       curve=trainee.curve, train_curve=trainee.train_curve, final_val_loss=trainee.curve[-1][1],
                       train_seconds=round(trainee.seconds, 2), tokens_per_s=trainee.tokens_per_s,
                       first_step_s=trainee.first_steps, lambdas=lambda_table(trainee.model).tolist(),
                       **{k: described[trainee.key][k] for k in ("parameters", "non_embedding_parameters")})
    lockstep.checkpoint.unlink(missing_ok=True)
