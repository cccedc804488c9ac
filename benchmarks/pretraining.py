"""What every pre-training study shares: data, seeded batch order, the training loop, validation loss, the paper's
tokens-to-match metric, seed statistics, scaling fits and a resumable store of finished runs.

The study scripts (`bench_pretrain.py`, `bench_param_efficiency.py`, `bench_uptrain.py`, `bench_svformer_gqa.py`)
only choose what to train and how to report it; anything two of them need lives here, so a number means the same
thing in every table.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import math
import os
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from transformers import get_cosine_with_min_lr_schedule_with_warmup

from resformer_hf.text import pack_blocks, split_documents, token_stream, train_tokenizer

from common import REPO_ROOT, build_model, environment_line, setup_device

try:
    import fcntl
except ImportError:  # Windows: no advisory locks; one study process per store there
    fcntl = None

DEFAULT_CORPUS = REPO_ROOT.parent / "shared" / "data" / "corpus"

# ---- data ----------------------------------------------------------------------------------------------------------


def read_corpus(corpus_dir: Path) -> list[str]:
    """Every `*.txt` document of the corpus folder, in name order."""
    files = sorted(Path(corpus_dir).glob("*.txt"))
    if not files:
        raise SystemExit(f"no *.txt files in {corpus_dir}; pass --corpus-dir pointing at plain-text files.")
    return [path.read_text(encoding="utf-8") for path in files]


@dataclass
class Data:
    """A tokenizer and the packed [N, seq_len] training and validation blocks every model of a study sees."""

    tokenizer: object
    train: torch.Tensor
    val: torch.Tensor

    @property
    def vocab_size(self) -> int:
        return len(self.tokenizer)


def _cached_tokenizer(train_texts: list[str], vocab_size: int, cache: Path | None):
    """The text pipeline's byte-level BPE, trained on the training split only; cached so resumed runs skip it."""
    from transformers import AutoTokenizer

    if cache is not None and (cache / "tokenizer.json").is_file():
        return AutoTokenizer.from_pretrained(cache)
    tokenizer = train_tokenizer(train_texts, vocab_size)
    if cache is not None:
        tokenizer.save_pretrained(cache)
    return tokenizer


def _cached_streams(tokenizer, train_texts: list[str], val_texts: list[str], cache: Path | None) -> dict:
    """Both splits as token streams, saved beside the cached tokenizer (tokenizing a corpus takes a CPU-minute)."""
    path = cache / "streams.pt" if cache is not None else None
    if path is not None and path.is_file():
        return torch.load(path)
    streams = {"train": token_stream(tokenizer, train_texts), "val": token_stream(tokenizer, val_texts)}
    if path is not None:
        torch.save(streams, path.with_suffix(".tmp"))
        os.replace(path.with_suffix(".tmp"), path)
    return streams


def prepare_data(texts: Sequence[str], *, vocab_size: int, val_fraction: float, seq_len: int, val_tokens: int,
                 cache: bool = True) -> Data:
    """Split every document (held-out tail), train the tokenizer on the training split, pack both splits in blocks.

    Validation keeps `val_tokens` worth of evenly spaced blocks of the held-out tails (all of them if fewer), so an
    evaluation is cheap and always scores the same windows.
    """
    train_texts, val_texts = split_documents(texts, val_fraction)
    digest = hashlib.sha1("\0".join([str(vocab_size), *train_texts, "\1", *val_texts]).encode()).hexdigest()
    folder = Path(tempfile.gettempdir()) / f"resformer-bench-data-{digest[:12]}" if cache else None
    tokenizer = _cached_tokenizer(train_texts, vocab_size, folder)
    streams = _cached_streams(tokenizer, train_texts, val_texts, folder)
    train, val = pack_blocks(streams["train"], seq_len), pack_blocks(streams["val"], seq_len)
    if len(train) == 0 or len(val) == 0:
        raise SystemExit(f"the text is too short for --seq-len {seq_len}: no complete training or validation block.")
    if val_tokens and len(val) * seq_len > val_tokens:
        keep = max(1, val_tokens // seq_len)
        val = val[torch.linspace(0, len(val) - 1, keep).round().long()]
    return Data(tokenizer, train, val)


def batch_order(num_sequences: int, batch_size: int, steps: int, seed: int) -> torch.Tensor:
    """[steps, batch_size] sequence indices: a seeded shuffle per epoch, identical for every model given the seed."""
    generator = torch.Generator().manual_seed(seed)
    needed = steps * batch_size
    epochs = math.ceil(needed / num_sequences)
    order = torch.cat([torch.randperm(num_sequences, generator=generator) for _ in range(epochs)])
    return order[:needed].view(steps, batch_size)


# ---- models --------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ModelSize:
    hidden_size: int
    layers: int
    heads: int
    kv_heads: int | None = None  # None: multi-head attention
    intermediate_size: int | None = None  # None: 8/3 of hidden, a multiple of 32
    cross_layer_attention: int | None = None  # ResFormer configs only: layers per group sharing K and V (CLA)

    @property
    def intermediate(self) -> int:
        return self.intermediate_size or max(32, round(self.hidden_size * 8 / 3 / 32) * 32)

    def describe(self) -> str:
        kv = "" if self.kv_heads in (None, self.heads) else f" ({self.kv_heads} kv)"
        cla = f", CLA{self.cross_layer_attention}" if (self.cross_layer_attention or 1) > 1 else ""
        return f"hidden {self.hidden_size}, {self.layers} layers, {self.heads} heads{kv}{cla}, MLP {self.intermediate}"

    def fields(self, data: Data, seq_len: int) -> dict:
        """Keyword arguments of `common.build_model` for this size and the data's tokenizer."""
        tokenizer = data.tokenizer
        cla = {"cross_layer_attention": self.cross_layer_attention} if self.cross_layer_attention else {}
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


def train(model, data: Data, budget: Budget, order: torch.Tensor, device: torch.device, *, label: str = "",
          probe: Callable[[object], object] | None = None, lambda_lr_scale: float = 1.0) -> dict:
    """Train `model` on `data.train[order[step]]` for `len(order)` steps and return its validation curve.

    Returns `curve` ([(training tokens, validation loss)], starting at 0 tokens), `train_curve` ([(training tokens,
    mean and max training loss of the steps since the previous evaluation)], where loss spikes show), `train_seconds`
    (optimizer steps only, evaluation excluded) and, with `probe`, `probes`: `probe(model)` at every evaluation.
    """
    model.to(device).train()
    groups = parameter_groups(model, budget.weight_decay, budget.lr, lambda_lr_scale)
    optimizer = torch.optim.AdamW(groups, lr=budget.lr, betas=(0.9, 0.95))
    steps = len(order)
    scheduler = get_cosine_with_min_lr_schedule_with_warmup(
        optimizer, num_warmup_steps=max(1, int(budget.warmup * steps)), num_training_steps=steps,
        min_lr_rate=budget.min_lr_rate,
    )
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


# ---- metrics -------------------------------------------------------------------------------------------------------


def tokens_to_reach(curve: Sequence[Sequence[float]], target: float) -> float | None:
    """Training tokens at which a validation curve first reaches `target`, interpolated linearly between
    evaluations; None if it never does."""
    for (t0, l0), (t1, l1) in zip(curve, curve[1:]):
        if l0 <= target:
            return float(t0)
        if l1 <= target:
            return t0 + (t1 - t0) * (l0 - target) / (l0 - l1)
    return None


def interpolate_curve(curve: Sequence[Sequence[float]], tokens: Sequence[float]) -> np.ndarray:
    """The curve's loss at each of `tokens` (linear between evaluations), to compare runs evaluated at other steps."""
    xs, ys = zip(*curve)
    return np.interp(np.asarray(tokens, dtype=float), np.asarray(xs, dtype=float), np.asarray(ys, dtype=float))


@dataclass
class Spread:
    """Mean and sample standard deviation (n − 1) of per-seed values."""

    mean: float
    std: float
    n: int

    def __str__(self) -> str:
        return f"{self.mean:.4f} ± {self.std:.4f}" if self.n > 1 else f"{self.mean:.4f}"

    def format(self, spec: str) -> str:
        return f"{self.mean:{spec}} ± {self.std:{spec}}" if self.n > 1 else f"{self.mean:{spec}}"


def spread(values: Sequence[float]) -> Spread:
    values = [float(v) for v in values]
    if not values:
        raise ValueError("spread() needs at least one value")
    return Spread(statistics.fmean(values), statistics.stdev(values) if len(values) > 1 else 0.0, len(values))


@dataclass
class PairedDifference:
    """Per-seed differences `a − b` of two models trained on the same seeds (same init draw and data order).

    `low`, `high`: the two-sided t confidence interval of the mean difference. The difference *exceeds seed noise*
    when that interval excludes 0; `negative` counts the seeds where `a` is lower, a check that needs no normality.
    """

    differences: list[float]
    mean: float
    std: float
    low: float
    high: float
    confidence: float
    negative: int

    @property
    def n(self) -> int:
        return len(self.differences)

    @property
    def significant(self) -> bool:
        return self.n > 1 and (self.high < 0 or self.low > 0)

    def verdict(self) -> str:
        if self.n < 2:
            return "one seed: no interval"
        if not self.significant:
            return "within seed noise"
        return "lower, beyond seed noise" if self.high < 0 else "higher, beyond seed noise"


def paired_difference(a: Sequence[float], b: Sequence[float], confidence: float = 0.95) -> PairedDifference:
    """Paired comparison of per-seed values (`a[i]` and `b[i]` from seed i): mean ± std of `a − b`, its t-interval."""
    from scipy import stats

    if len(a) != len(b) or not a:
        raise ValueError(f"paired_difference needs equally long, non-empty per-seed lists (got {len(a)}, {len(b)})")
    differences = [float(x) - float(y) for x, y in zip(a, b)]
    summary = spread(differences)
    if summary.n > 1:
        half = stats.t.ppf(0.5 + confidence / 2, summary.n - 1) * summary.std / math.sqrt(summary.n)
    else:
        half = math.inf
    return PairedDifference(differences, summary.mean, summary.std, summary.mean - half, summary.mean + half,
                            confidence, sum(d < 0 for d in differences))


# ---- loss vs model size --------------------------------------------------------------------------------------------


@dataclass
class LogLinearFit:
    """`L(N) = alpha − beta·ln N`: validation loss falling by `beta` per e-fold of non-embedding parameters."""

    alpha: float
    beta: float

    def loss(self, parameters) -> np.ndarray:
        return self.alpha - self.beta * np.log(np.asarray(parameters, dtype=float))

    def parameters_for(self, loss: float) -> float:
        """The model size at which this fit reaches `loss` (inverse of `loss`)."""
        if self.beta <= 0:
            return math.nan
        return float(math.exp((self.alpha - loss) / self.beta))

    def describe(self) -> str:
        return f"L = {self.alpha:.3f} − {self.beta:.4f}·ln N"


def fit_log_linear(parameters: Sequence[float], losses: Sequence[float]) -> LogLinearFit:
    """Least-squares `L = alpha − beta·ln N` over every (size, loss) point, one point per run."""
    if len(set(parameters)) < 2:
        raise ValueError("a loss-vs-size fit needs at least two model sizes")
    slope, intercept = np.polyfit(np.log(np.asarray(parameters, dtype=float)), np.asarray(losses, dtype=float), 1)
    return LogLinearFit(float(intercept), float(-slope))


@dataclass
class PowerLawFit:
    """`L(N) = a·(N / 1e6)^(−b) + c`, the scaling-law form with an irreducible loss `c` (N in parameters)."""

    a: float
    b: float
    c: float

    def loss(self, parameters) -> np.ndarray:
        return self.a * (np.asarray(parameters, dtype=float) / 1e6) ** (-self.b) + self.c

    def parameters_for(self, loss: float) -> float:
        if loss <= self.c or self.a <= 0 or self.b <= 0:
            return math.nan
        return float(1e6 * ((loss - self.c) / self.a) ** (-1 / self.b))

    def describe(self) -> str:
        return f"L = {self.a:.3f}·(N/1M)^−{self.b:.3f} + {self.c:.3f}"


def fit_power_law(parameters: Sequence[float], losses: Sequence[float]) -> PowerLawFit | None:
    """Least-squares `L = a·(N/1e6)^−b + c`; None when it is not identifiable (fewer than 4 sizes) or does not
    converge to a > 0, b > 0."""
    from scipy.optimize import curve_fit

    if len(set(parameters)) < 4:
        return None
    x = np.asarray(parameters, dtype=float) / 1e6
    y = np.asarray(losses, dtype=float)

    def model(n, a, b, c):
        return a * n ** (-b) + c

    try:
        (a, b, c), _ = curve_fit(model, x, y, p0=(float(np.ptp(y)) or 1.0, 0.5, float(y.min()) - 0.5),
                                 bounds=([0, 0, 0], [np.inf, 5, np.inf]), maxfev=20000)
    except (RuntimeError, ValueError):
        return None
    if a <= 0 or b <= 0:
        return None
    return PowerLawFit(float(a), float(b), float(c))


def parameter_saving(llama_fit, resformer_fit, largest: float) -> float:
    """`1 − N_res / N_max`: the share of parameters ResFormer can drop and still reach Llama's fitted loss at the
    largest size `N_max` (negative when it needs more)."""
    return 1.0 - resformer_fit.parameters_for(float(llama_fit.loss(largest))) / largest


# ---- resumable results ---------------------------------------------------------------------------------------------


def portable_path(path: str | os.PathLike) -> str:
    """`path` relative to the repository (e.g. `../shared/data/corpus`): what results files record, since an absolute
    path names one machine's layout."""
    return os.path.relpath(Path(path).resolve(), REPO_ROOT)


def portable_config(config: dict) -> dict:
    """A study config with its corpus folder as a repository-relative path (stores written with an absolute path
    still match the settings they were trained with)."""
    if config.get("corpus_dir") is not None and os.path.isabs(config["corpus_dir"]):
        config = {**config, "corpus_dir": portable_path(config["corpus_dir"])}
    return config


class RunStore:
    """Finished runs of a study in one JSON file, written after every run so an interrupted study resumes.

    Runs are kept only while the study's settings (`config`) are unchanged: a changed flag starts over, so a table
    never mixes runs trained differently. Several processes may share a store (e.g. one per seed, to use every core):
    each save merges the runs other processes saved meanwhile under a lock, and a run another process finished is
    skipped, so none is lost or trained twice on purpose. A store that is replaced (other settings, or `fresh`) is
    first copied aside, never lost.
    """

    def __init__(self, path: Path, config: dict, *, fresh: bool = False):
        self.path = Path(path)
        self.config = portable_config(json.loads(json.dumps(config)))  # as JSON round-trips it: exact comparisons
        self.runs: dict[str, dict] = {}
        self.meta: dict = {}
        self.retrained: set[str] = set()  #: `fresh`: saved runs this process trains again (not merged back)
        if not self.path.is_file():
            return
        saved = json.loads(self.path.read_text())
        same_settings = self._same_settings(saved)
        if same_settings and not fresh:
            self.runs = saved.get("runs", {})
            self.meta = saved.get("meta", {})
            return
        if same_settings:
            self.retrained = set(saved.get("runs", {}))
        with self._locked():
            kept = self._free_name(f"{self.path.stem}.replaced-{time.strftime('%Y%m%d-%H%M%S')}")
            shutil.copy2(self.path, kept)
        reason = "--fresh" if same_settings else "saved with other settings"
        print(f"{self.path}: {reason}, starting over (the saved runs are kept in {kept})", flush=True)

    def _free_name(self, stem: str) -> Path:
        """`<stem>.json` beside the store, or `<stem>-2.json`, ...: the first name nothing has."""
        names = (f"{stem}{'' if n == 1 else f'-{n}'}{self.path.suffix}" for n in range(1, 10**6))
        return next(path for path in map(self.path.with_name, names) if not path.exists())

    def __contains__(self, key: str) -> bool:
        return key in self.runs

    def __getitem__(self, key: str) -> dict:
        return self.runs[key]

    def put(self, key: str, result: dict) -> None:
        self.runs[key] = result
        self.save()

    @contextlib.contextmanager
    def _locked(self) -> Iterator[None]:
        """An exclusive lock on `<store>.lock` (POSIX; elsewhere concurrent studies are not supported)."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.path.with_name(self.path.name + ".lock"), "a") as handle:
            if fcntl is not None:
                fcntl.flock(handle, fcntl.LOCK_EX)
            yield

    def _same_settings(self, saved: dict) -> bool:
        return portable_config(saved.get("config") or {}) == self.config

    def _merge_saved(self) -> None:
        """Add the runs another process saved with the same settings (this process's own runs win)."""
        if not self.path.is_file():
            return
        saved = json.loads(self.path.read_text())
        if self._same_settings(saved):
            others = {key: run for key, run in saved.get("runs", {}).items() if key not in self.retrained}
            self.runs = {**others, **self.runs}
            self.meta = {**saved.get("meta", {}), **self.meta}

    def save(self) -> None:
        with self._locked():
            self._merge_saved()
            payload = {"config": self.config, "meta": self.meta, "runs": self.runs}
            staging = self.path.with_name(self.path.name + ".tmp")
            staging.write_text(json.dumps(payload, indent=1))
            os.replace(staging, self.path)

    def run(self, key: str, job: Callable[..., dict], *args) -> dict:
        """The stored result of `key`, or `job(*args)`'s, stored before returning."""
        with self._locked():
            self._merge_saved()  # another process may have finished it meanwhile
        if key in self.runs:
            print(f"{key}: done, skipped", flush=True)
        else:
            print(f"training {key}", flush=True)
            self.put(key, job(*args))
        return self.runs[key]


# ---- command line --------------------------------------------------------------------------------------------------


def add_study_args(parser: argparse.ArgumentParser, *, tokens: int, hidden: int = 128, layers: int = 6,
                   heads: int = 4, eval_every: int = 50, num_seeds: int = 3, size_flags: bool = True) -> None:
    """Data, size, budget and seed flags shared by the studies, with each study's defaults (`size_flags=False`: the
    study sets model sizes its own way)."""
    data = parser.add_argument_group("data")
    data.add_argument("--corpus-dir", type=Path, default=DEFAULT_CORPUS, help="folder of *.txt training text")
    data.add_argument("--sample-chars", type=int, default=None,
                      help="train on the first N characters of the bundled sample instead of --corpus-dir (tests)")
    data.add_argument("--val-fraction", type=float, default=0.02, help="held-out tail of each file (default 0.02)")
    data.add_argument("--val-tokens", type=int, default=32768, help="held-out tokens scored per evaluation")
    data.add_argument("--vocab-size", type=int, default=2048)
    if size_flags:
        size = parser.add_argument_group("model size")
        size.add_argument("--hidden-size", type=int, default=hidden)
        size.add_argument("--layers", type=int, default=layers)
        size.add_argument("--heads", type=int, default=heads)
        size.add_argument("--intermediate-size", type=int, default=None, help="default: 8/3 hidden, multiple of 32")
    budget = parser.add_argument_group("training budget")
    budget.add_argument("--tokens", type=int, default=tokens, help=f"training tokens per model (default {tokens:,})")
    budget.add_argument("--seq-len", type=int, default=128)
    budget.add_argument("--batch-size", type=int, default=16)
    budget.add_argument("--lr", type=float, default=3e-3)
    budget.add_argument("--warmup", type=float, default=0.05, help="warmup fraction of the steps")
    budget.add_argument("--weight-decay", type=float, default=0.1)
    budget.add_argument("--eval-every", type=int, default=eval_every, help="steps between validation evaluations")
    parser.add_argument("--seeds", type=int, nargs="+", default=None,
                        help=f"seeds (init and data order; the same for every model within a seed); default: "
                        f"{num_seeds} seeds from --seed")
    parser.set_defaults(num_seeds=num_seeds)
    parser.add_argument("--fresh", action="store_true", help="retrain runs already saved with the same settings")
    parser.add_argument("--report-only", action="store_true", help="rebuild the table and plot from the saved runs")


def seeds_from_args(args: argparse.Namespace) -> list[int]:
    """`--seeds`, or `--num-seeds` consecutive seeds starting at `--seed` (common's flag, default 0)."""
    return list(args.seeds) if args.seeds else list(range(args.seed, args.seed + args.num_seeds))


def load_texts(args: argparse.Namespace) -> tuple[list[str], str]:
    """The study's documents and a description for its table."""
    if args.sample_chars:
        from resformer_hf.text import SAMPLE_DESCRIPTION, sample_text

        return [sample_text(args.sample_chars)], f"first {args.sample_chars:,} characters of the {SAMPLE_DESCRIPTION}"
    names = ", ".join(p.name for p in sorted(Path(args.corpus_dir).glob("*.txt")))
    return read_corpus(args.corpus_dir), f"{args.corpus_dir.name}/ ({names})"


def data_from_args(args: argparse.Namespace) -> tuple[Data, str]:
    texts, description = load_texts(args)
    data = prepare_data(texts, vocab_size=args.vocab_size, val_fraction=args.val_fraction, seq_len=args.seq_len,
                        val_tokens=args.val_tokens)
    description += (f"; byte-level BPE of {data.vocab_size} tokens trained on the training split; "
                    f"{data.train.numel() / 1e6:.2f}M training tokens, validation on {data.val.numel() / 1e3:.0f}k "
                    f"held-out tokens (evenly spaced blocks of the last {args.val_fraction:.0%} of each file)")
    return data, description


def budget_from_args(args: argparse.Namespace, tokens: int | None = None) -> Budget:
    return Budget(tokens=tokens or args.tokens, batch_size=args.batch_size, seq_len=args.seq_len, lr=args.lr,
                  warmup=args.warmup, weight_decay=args.weight_decay, eval_every=args.eval_every)


def size_from_args(args: argparse.Namespace, **overrides) -> ModelSize:
    fields = dict(hidden_size=args.hidden_size, layers=args.layers, heads=args.heads,
                  kv_heads=getattr(args, "kv_heads", None), intermediate_size=args.intermediate_size,
                  cross_layer_attention=getattr(args, "cross_layer_attention", None))
    fields.update(overrides)
    return ModelSize(**fields)


def command_line(script: str, argv: Sequence[str] | None) -> str:
    """The command that regenerates a study's results, as its table quotes it."""
    arguments = sys.argv[1:] if argv is None else argv
    arguments = [portable_path(a) if os.path.isabs(a) and os.path.exists(a) else a for a in arguments]
    return " ".join([f"python benchmarks/{script}", *arguments])


def study_config(args: argparse.Namespace, *extra: str) -> dict:
    """The flags that decide a study's numbers: a saved run is reused only while they are unchanged."""
    names = ["corpus_dir", "sample_chars", "val_fraction", "val_tokens", "vocab_size", "hidden_size", "layers",
             "heads", "intermediate_size", "tokens", "seq_len", "batch_size", "lr", "warmup", "weight_decay",
             "eval_every", "device", *extra]
    config = {name: getattr(args, name) for name in names if hasattr(args, name)}
    return portable_config(config)


def open_study(args: argparse.Namespace, name: str, *config_flags: str) -> RunStore:
    """The study's run store `OUT/<name>.json`, keyed by `study_config(args, *config_flags)`."""
    args.out.mkdir(parents=True, exist_ok=True)
    return RunStore(args.out / f"{name}.json", study_config(args, *config_flags), fresh=args.fresh)


def prepare_training(
    store: RunStore, args: argparse.Namespace, script: str, argv: Sequence[str] | None, *, describe_size: bool = True
) -> tuple[torch.device, Data]:
    """Device and data for the runs still to train; records in the store how and on what they are measured."""
    device = setup_device(args)
    data, description = data_from_args(args)
    meta = {"command": command_line(script, argv), "environment": environment_line(device)}
    if describe_size:
        meta["size"] = size_from_args(args).describe()
    store.meta.update(meta, budget=budget_from_args(args).describe(), data=description)
    return device, data
