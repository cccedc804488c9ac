"""What a study declares: its arms (the models it compares), its settings (data, size, budget), its seeds, an optional
grid (contexts, learning rates, sizes or corpora) and its report. `catalogue.py` holds the declarations; nothing here
trains or reads a run.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from fractions import Fraction

from benchmarks.common import BASELINE
from benchmarks.studies.training import Budget, ModelSize

#: The fields of `Settings` that choose the text a study trains on (a study tuned on another keeps its own).
CORPUS_FIELDS = ("corpus", "sample_chars")


class ImpossibleSettings(SystemExit):
    """Settings that cannot be trained (a batch that does not divide, a malformed size): the message says why."""


@dataclass(frozen=True)
class Settings:
    """Data, model size and training budget shared by every arm of a study (a grid changes one field per cell)."""

    corpus: str = "english"  #: `english`, `python-stdlib` or a folder of *.txt files
    sample_chars: int | None = None  #: train on the first N characters of the bundled sample instead (tests)
    vocab_size: int = 2048
    val_fraction: float = 0.02
    val_tokens: int = 32768
    hidden_size: int = 128
    layers: int = 6
    heads: int = 4
    intermediate_size: int | None = None  #: None: 8/3 of hidden, a multiple of 32
    head_dim: int | None = None  #: with a `sizes` grid: heads = hidden / head_dim
    tokens: int = 1_200_000
    seq_len: int = 128
    batch_size: int = 16
    tokens_per_step: int | None = None  #: when set, the batch is tokens_per_step / seq_len at every context
    lr: float = 3e-3
    warmup: float = 0.05
    weight_decay: float = 0.1
    eval_every: int = 50

    @property
    def batch(self) -> int:
        if self.tokens_per_step is None:
            return self.batch_size
        if self.tokens_per_step % self.seq_len:
            raise ImpossibleSettings(f"--tokens-per-step {self.tokens_per_step} is not a multiple of context "
                                     f"{self.seq_len}.")
        return self.tokens_per_step // self.seq_len

    def budget(self, tokens: int | None = None, lr: float | None = None) -> Budget:
        return Budget(tokens=tokens or self.tokens, batch_size=self.batch, seq_len=self.seq_len,
                      lr=self.lr if lr is None else lr, warmup=self.warmup, weight_decay=self.weight_decay,
                      eval_every=self.eval_every)

    def at(self, name: str, value) -> Settings:
        """These settings in one grid cell: `size` is `HIDDENxLAYERS` (heads = hidden / head_dim), any other name a
        field."""
        if name != "size":
            return dataclasses.replace(self, **{name: value})
        try:
            hidden, layers = (int(part) for part in str(value).lower().split("x"))
        except ValueError:
            raise ImpossibleSettings(f"--sizes takes HIDDENxLAYERS items such as 128x6, got {value!r}") from None
        head_dim = self.head_dim or self.hidden_size // self.heads
        if hidden % head_dim:
            raise ImpossibleSettings(f"size {value}: hidden {hidden} is not a multiple of --head-dim {head_dim}")
        return dataclasses.replace(self, hidden_size=hidden, layers=layers, heads=hidden // head_dim)


@dataclass(frozen=True)
class Arm:
    """A model a study trains from scratch: `llama` or a `value_residual` variant, with its attention layout."""

    name: str
    variant: str | None = None  #: default: the arm's name
    kv_heads: int | Fraction | None = None  #: an int, a Fraction of the query heads, or None (multi-head)
    cross_layer_attention: int | None = None  #: layers per group sharing K and V (ResFormer configs only)
    description: str = ""
    value_embeddings: str | tuple[int, ...] | None = None  #: layers with a value-embedding table (ResFormer configs)
    intermediate_size: int | None = None  #: this arm's MLP width instead of the settings' (a parameter-matched Llama)
    lr: float | None = None  #: this arm's learning rate instead of the settings' (its best in an lr study)

    @property
    def model(self) -> str:
        return self.variant or self.name

    def size(self, settings: Settings) -> ModelSize:
        kv = self.kv_heads
        if isinstance(kv, Fraction):
            kv = max(1, round(settings.heads * kv))
        if kv is not None and settings.heads % kv:
            raise SystemExit(f"arm {self.name}: {settings.heads} query heads are not a multiple of {kv} kv heads; "
                             "give --heads a multiple of it")
        return ModelSize(settings.hidden_size, settings.layers, settings.heads, kv,
                         self.intermediate_size or settings.intermediate_size, self.cross_layer_attention,
                         self.value_embeddings)


@dataclass(frozen=True)
class ContinuedArm:
    """A way to continue from the uptrain study's pre-trained source: itself, or a conversion of it."""

    name: str
    variant: str  #: BASELINE: the source itself, continued
    init: str | None = None  #: the converter's --init
    lambda_overrides: dict = field(default_factory=dict)  #: config fields changed after conversion (other inits)
    lambda_lr_scale: float = 1.0  #: λ learning rate = continuation lr × this
    description: str = ""
    #: Value-embedding tables given at load (`value_embeddings`), zero at first; with variant "none" the Llama itself
    #: loaded as a ResFormer without value residual, which computes the Llama's function exactly
    value_embeddings: str | None = None


@dataclass(frozen=True)
class Continuation:
    """The uptrain study's pre-training: one source model on part of the training blocks, continued on the rest."""

    pretrain_tokens: int = 1_200_000
    pretrain_lr: float = 3e-3
    pretrain_seed: int = 0  #: the source's init, batch order and data split
    continue_fraction: float = 0.4  #: share of the training blocks kept for the continuation
    #: The source's architecture, a `model_type` the converter takes (`resformer_hf.conversion.bases`), built with
    #: transformers' own class; `source_fields`: its config fields beyond the size (a head size, Gemma 3's window)
    source: str = BASELINE
    source_fields: tuple[tuple[str, object], ...] = ()

    @property
    def source_name(self) -> str:
        from resformer_hf.conversion.bases import BASES

        return BASES[self.source].name


@dataclass(frozen=True)
class Grid:
    """One settings field the study varies: each value is a cell with its own runs (`flag` overrides the values)."""

    flag: str  #: command-line flag, e.g. `contexts` for `--contexts`
    name: str  #: the `Settings` field it sets, or `size` (HIDDENxLAYERS)
    values: tuple


@dataclass(frozen=True)
class Study:
    """A study: arms × grid cells × seeds, trained by one runner into one run store, and the report it writes."""

    name: str
    question: str  #: what it asks, in one line
    report: str  #: the report it writes (`reports.RENDERERS`)
    arms: tuple
    settings: Settings = Settings()
    seeds: tuple[int, ...] = (0, 1, 2)
    grid: Grid | None = None
    tuned_from: str | None = None  #: each arm trains only at its best learning rate in that study's grid
    continuation: Continuation | None = None  #: set for the uptrain study: arms are `ContinuedArm`s
    comparisons: tuple[tuple[str, tuple[str, ...]], ...] = ()  #: (table, its arms) for reports with several tables
    stored_seeds: bool = False  #: the report also covers every other seed the store holds of the study's runs
    #: paired report: the arms each other arm is put head to head with (default: the first arm after Llama), e.g. a
    #: parameter-matched control
    references: tuple[str, ...] = ()

    def arm(self, name: str):
        for arm in self.arms:
            if arm.name == name:
                return arm
        raise SystemExit(f"study {self.name} has no arm {name!r}; its arms: {', '.join(a.name for a in self.arms)}")

    @property
    def baseline(self) -> str:
        """The arm every difference is measured against: `llama`, or the first arm when none is called that."""
        names = [arm.name for arm in self.arms]
        return BASELINE if BASELINE in names else names[0]
