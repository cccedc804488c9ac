"""Every study, declared: what it trains (arms, settings, seeds, grid) and which report it writes.

Adding seeds, an arm or a study is an edit here; the runner (`python -m benchmarks.studies run NAME`) trains what the
store does not hold yet and the report reads the rest. Two studies that ask for the same run (same data, model, budget,
seed and device) share it: it is trained once.
"""

from __future__ import annotations

import dataclasses
from fractions import Fraction

from benchmarks.common import BASELINE
from benchmarks.studies.spec import Arm, Continuation, ContinuedArm, Grid, Settings, Study

#: The arms of the pre-training studies: Llama and the three ResFormer variants they compare with it.
SEED_ARMS = (Arm(BASELINE), Arm("identity"), Arm("learnable_plus"), Arm("svformer"))
#: The context-length study's context-512 settings, which the tuned and baseline studies share.
CONTEXT_512 = Settings(seq_len=512, batch_size=4)
LEARNING_RATES = (1e-3, 3e-3, 6e-3)
#: The value-embedding studies' arms (issue 56): Llama, learnable_plus, value embeddings alone and with learnable_plus
#: (nanochat's alternating layout: layers 1, 3, 5 of 6, +786,576 parameters at the context-512 settings: three
#: [2048, 128] tables and their [4, 12] gates), and a Llama with a 704-wide MLP instead of 352, the parameter-matched
#: control (2,278,880 parameters, 1.1 % more than the largest arm's 2,254,619; Llama 1,468,032).
VALUE_EMBEDDING_ARMS = (
    Arm(BASELINE, description="Llama (1,468,032 parameters)"),
    Arm("learnable_plus", description="ResFormer (learnable-plus λ; +11 parameters)"),
    Arm("value_embeddings", "none", value_embeddings="alternating",
        description="value embeddings alone (layers 1, 3, 5; +786,576 parameters)"),
    Arm("value_embeddings+learnable_plus", "learnable_plus", value_embeddings="alternating",
        description="value embeddings + learnable_plus (+786,587 parameters)"),
    Arm("llama_wide", BASELINE, intermediate_size=704,
        description="Llama with a 704-wide MLP: the parameter-matched control (+810,848 parameters)"),
)


def uptrain_from(base: str, name: str, fields: tuple) -> Study:
    """uptrain_long's question for another base (issue 67): a source of that architecture pre-trained here (the
    Llama's size, transformers' own class), converted, continued 2.5M tokens, against the source continued as it is."""
    return Study(
        f"uptrain_{base.removesuffix('_text')}", f"does uptrain_long's result carry over to a {name}-shaped source? "
        f"λ alone, tables, tables + λ on a converted {name}, continued 2.5M tokens",
        report="uptrain", settings=Settings(tokens=2_500_000, lr=1e-3, eval_every=25),
        continuation=Continuation(source=base, source_fields=fields),
        arms=(
            ContinuedArm(base.removesuffix("_text"), BASELINE, description=f"(a) the {name}, continued as it is"),
            ContinuedArm("learnable-preserve", "learnable", "preserve",
                         description="(b) converted, λ_first = 0, λ_self = 1"),
            ContinuedArm("value_embeddings", "none", "preserve", value_embeddings="alternating",
                         description=f"(e) the {name} given value-embedding tables (layers 1, 3, 5, at zero), no λ"),
            ContinuedArm("learnable-preserve+value_embeddings", "learnable", "preserve",
                         value_embeddings="alternating", description="(f) (b) with value-embedding tables"),
        ),
    )


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
        "value_embeddings_lr", "value embeddings (issue 56): every arm at 1e-3, 3e-3 and 6e-3 on English text, the "
        "grid its paired study takes each arm's best learning rate from (Llama's and learnable_plus's runs are "
        "lr_sweep's)", report="tuned", arms=VALUE_EMBEDDING_ARMS, settings=CONTEXT_512,
        grid=Grid("lrs", "lr", LEARNING_RATES),
    ),
    Study(
        "value_embeddings_lr_code", "value embeddings' learning-rate grid on source code (CPython's standard library)",
        report="tuned", arms=VALUE_EMBEDDING_ARMS, settings=dataclasses.replace(CONTEXT_512, corpus="python-stdlib"),
        grid=Grid("lrs", "lr", LEARNING_RATES),
    ),
    Study(
        "value_embeddings", "value embeddings (tables indexed by the token, added to V) alone and with "
        "learnable_plus, against Llama, learnable_plus and a parameter-matched wider Llama: ten seeds, both corpora, "
        "at lr 3e-3 (Llama's and learnable_plus's best in lr_sweep; give an arm `lr=` once value_embeddings_lr "
        "finds another best for it)",
        report="paired", arms=VALUE_EMBEDDING_ARMS, settings=CONTEXT_512, seeds=tuple(range(10)),
        grid=Grid("corpora", "corpus", ("english", "python-stdlib")), references=("learnable_plus", "llama_wide"),
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
    Study(
        "uptrain_long", "does a converted Llama gain when it gets value-embedding tables, and does λ alone gain with "
        "a 5× longer continuation (2.5M tokens)? the uptrain study's pre-trained Llama, continued",
        report="uptrain", settings=Settings(tokens=2_500_000, lr=1e-3, eval_every=25), continuation=Continuation(),
        arms=(
            ContinuedArm("llama", BASELINE, description="(a) the Llama, continued as it is"),
            ContinuedArm("learnable-preserve", "learnable", "preserve",
                         description="(b) converted, λ_first = 0, λ_self = 1"),
            ContinuedArm("value_embeddings", "none", value_embeddings="alternating",
                         description="(e) the Llama given value-embedding tables (layers 1, 3, 5, at zero), no λ"),
            ContinuedArm("learnable-preserve+value_embeddings", "learnable", "preserve",
                         value_embeddings="alternating", description="(f) (b) with value-embedding tables"),
        ),
    ),
    *(uptrain_from(base, name, fields) for base, name, fields in (
        ("qwen3", "Qwen 3", (("head_dim", 32),)),  # q/k norms per head
        # four norms a block, (1 + w) norms, √hidden embeddings, 5 sliding layers of 6 (window 32 of the 128-token
        # context), a RoPE base per layer type, GELU-tanh
        ("gemma3_text", "Gemma 3", (("head_dim", 32), ("query_pre_attn_scalar", 32), ("sliding_window", 32))),
    )),
)}


def study(name: str) -> Study:
    if name not in STUDIES:
        raise SystemExit(f"no study {name!r}; the studies: {', '.join(STUDIES)}")
    return STUDIES[name]
