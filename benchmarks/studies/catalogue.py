"""Every study, declared: what it trains (arms, settings, seeds, grid) and which report it writes.

Adding seeds, an arm or a study is an edit here; the runner (`python -m benchmarks.studies run NAME`) trains what the
store does not hold yet and the report reads the rest. Two studies that ask for the same run (same data, model, budget,
seed and device) share it: it is trained once.
"""

from __future__ import annotations

from fractions import Fraction

from benchmarks.common import BASELINE
from benchmarks.studies.spec import Arm, Continuation, ContinuedArm, Grid, Settings, Study

#: The arms of the pre-training studies: Llama and the three ResFormer variants they compare with it.
SEED_ARMS = (Arm(BASELINE), Arm("identity"), Arm("learnable_plus"), Arm("svformer"))
#: The context-length study's context-512 settings, which the tuned and baseline studies share.
CONTEXT_512 = Settings(seq_len=512, batch_size=4)
LEARNING_RATES = (1e-3, 3e-3, 6e-3)

STUDIES: dict[str, Study] = {study.name: study for study in (
    Study(
        "pretrain", "the paper's headline at CPU scale: Llama vs ResFormer variants from scratch, with seeds",
        report="seeds", arms=SEED_ARMS,
    ),
    Study(
        "context_length", "does the gain hold as context grows (128, 512, 1024 tokens, 2048 tokens per step)?",
        report="contexts", arms=SEED_ARMS, settings=Settings(tokens_per_step=2048),
        grid=Grid("contexts", "seq_len", (128, 512, 1024)),
    ),
    Study(
        "lr_sweep", "is the gain real after tuning? every arm at 1e-3, 3e-3 and 6e-3, at its best vs Llama at Llama's",
        report="tuned", arms=SEED_ARMS, settings=CONTEXT_512, grid=Grid("lrs", "lr", LEARNING_RATES),
    ),
    Study(
        "second_corpus", "the tuned comparison on source code (CPython's standard library), each arm at its best lr",
        report="tuned", arms=SEED_ARMS, settings=Settings(corpus="python-stdlib", seq_len=512, batch_size=4),
        grid=Grid("lrs", "lr", LEARNING_RATES), tuned_from="lr_sweep",
    ),
    Study(
        "tuned_seeds", "ten seeds at the tuned settings (context 512, lr 3e-3), both corpora: beyond seed noise?",
        report="paired", arms=(Arm(BASELINE), Arm("learnable_plus"), Arm("svformer")), settings=CONTEXT_512,
        seeds=tuple(range(10)), grid=Grid("corpora", "corpus", ("english", "python-stdlib")), stored_seeds=True,
    ),
    Study(
        "gated", "the data-dependent mix (`gated`: a learned gate per token and kv head) against learnable_plus and "
        "Llama at the tuned settings, both corpora; where do the gates end up?",
        report="paired", arms=(Arm(BASELINE), Arm("learnable_plus"), Arm("gated")), settings=CONTEXT_512,
        seeds=tuple(range(10)), grid=Grid("corpora", "corpus", ("english", "python-stdlib")),
    ),
    Study(
        "baselines", "DenseFormer and NeuTRENO next to ResFormer; SVFormer next to GQA, CLA and SVFormer × CLA",
        report="baselines", settings=CONTEXT_512, seeds=tuple(range(10)),
        arms=(
            Arm(BASELINE, description="Llama"),
            Arm("learnable_plus", description="ResFormer (learnable-plus λ)"),
            Arm("neutreno", description="NeuTRENO (λ = 0.4)"),
            Arm("denseformer", description="DenseFormer (DWA after every block, dilation 1)"),
            Arm("svformer", description="SVFormer (values of layer 0 only)"),
            Arm("gqa", BASELINE, kv_heads=Fraction(1, 2), description="GQA (half the kv heads)"),
            Arm("cla2", "none", cross_layer_attention=2, description="CLA2 (layer pairs share K and V)"),
            Arm("svformer_cla2", "svformer", cross_layer_attention=2, description="SVFormer × CLA2"),
        ),
        comparisons=(
            ("quality", (BASELINE, "learnable_plus", "neutreno", "denseformer")),
            ("kv cache", (BASELINE, "svformer", "gqa", "cla2", "svformer_cla2")),
        ),
    ),
    Study(
        "param_efficiency", "validation loss against model size: how many fewer parameters reach Llama's loss?",
        report="sizes", arms=(Arm(BASELINE), Arm("learnable_plus")), seeds=(0, 1),
        settings=Settings(head_dim=16, tokens=800_000), grid=Grid("sizes", "size", ("32x2", "48x3", "64x4", "96x5")),
    ),
    Study(
        "svformer_gqa", "SVFormer + GQA vs Llamas with fewer kv heads at equal KV-cache bytes (the first arm)",
        report="kv_cache", seeds=(0,), settings=Settings(hidden_size=120, layers=5, heads=15),
        arms=(Arm("llama:3", BASELINE, kv_heads=3), Arm("svformer:5", "svformer", kv_heads=5),
              Arm("llama:5", BASELINE, kv_heads=5), Arm("llama:15", BASELINE, kv_heads=15)),
    ),
    Study(
        "uptrain", "is converting my Llama worth it? a converted checkpoint continued vs the Llama continued",
        report="uptrain", settings=Settings(tokens=500_000, lr=1e-3, eval_every=25), continuation=Continuation(),
        arms=(
            ContinuedArm("llama", BASELINE, description="(a) the Llama, continued as it is"),
            ContinuedArm("learnable-preserve", "learnable", "preserve",
                         description="(b) converted, λ_first = 0, λ_self = 1"),
            ContinuedArm("learnable_plus-preserve", "learnable_plus", "preserve",
                         description="(c) converted, λ_scale = 0, λ_self = 1 (zero logit gradient)"),
            ContinuedArm("learnable_plus-paper", "learnable_plus", "paper",
                         description="(d) converted with the paper's init: λ_scale = layers, λ_self = 0.5"),
            ContinuedArm("learnable_plus-preserve-lambda-lr30", "learnable_plus", "preserve", lambda_lr_scale=30.0,
                         description="preserve init, λ learning rate ×30"),
        ),
    ),
)}


def study(name: str) -> Study:
    if name not in STUDIES:
        raise SystemExit(f"no study {name!r}; the studies: {', '.join(STUDIES)}")
    return STUDIES[name]
