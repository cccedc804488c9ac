"""What the cost benchmark compares: model sizes and the ratio to Llama each variant should stay within.

Shared by `bench_cost.py` (timings, memory, op census), `instructions.py` (instruction counts) and the regression
gate in `tests/test_decode_instructions.py`, so that the goals are written down once.
"""

from __future__ import annotations

import argparse

from resformer_hf.remote_code.variants import PER_TOKEN, VARIANTS


def goal(metric: str, variant: str, hidden: int) -> float:
    """The ratio to Llama a variant should stay within; cells above it are bold.

    Decode steps (eager or compiled, timed or counted in instructions): the mixes 1.03 (fixed λ fold into v_proj's
    GEMM; learnable λ add their table, built from the parameters every step, and one `addcmul` a layer),
    `dense`, NeuTRENO and `gated` 1.06 (a few ops a layer: the depth sum, the correction, the gate's GEMM and lerp),
    DenseFormer 1.10 (a sum over all earlier blocks after every block) and SVFormer 1.00 (fewer ops than Llama). At
    hidden 256 × 8 layers a CPU step is ~95 % dispatch overhead, one op ~0.1 % of it; where a decode step is bound by
    reading the weights these ops are a rounding error. Prefill instructions follow the prefill time goal.
    """
    spec = VARIANTS.get(variant)
    keeps_all = spec is not None and spec.keeps_every_layers_values
    if metric == "memory":
        return 1.03 if keeps_all else 1.005
    if metric == "compiled step":
        return 1.01
    if "decode" in metric:
        if spec is not None and spec.drops_value_projections:
            return 1.0
        if spec is not None and spec.depth_weighted_average:
            return 1.10
        if spec is not None and (keeps_all or spec.lambdas == PER_TOKEN or variant == "neutreno"):
            return 1.06
        return 1.01 if spec is None or variant == "none" else 1.03
    return 1.05 if keeps_all else (1.01 if hidden >= 512 else 1.02)


def parse_size(text: str) -> tuple[int, int]:
    """'256x8' -> (hidden 256, 8 layers)."""
    try:
        hidden, layers = (int(part) for part in text.lower().split("x"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"size {text!r} must look like HIDDENxLAYERS, e.g. 256x8") from None
    return hidden, layers


def size_fields(hidden: int, layers: int, vocab_size: int, head_dim: int, max_positions: int,
                gqa_groups: int = 1) -> dict:
    """Config fields of a Llama-shaped model of hidden × layers (MLP 8/3 · hidden, rounded to 32)."""
    heads = max(1, hidden // head_dim)
    return dict(
        vocab_size=vocab_size, hidden_size=hidden, intermediate_size=max(32, round(hidden * 8 / 3 / 32) * 32),
        num_hidden_layers=layers, num_attention_heads=heads,
        num_key_value_heads=max(1, heads // gqa_groups), max_position_embeddings=max_positions,
        tie_word_embeddings=False,
    )


def add_model_args(parser: argparse.ArgumentParser) -> None:
    """The model shape and variant flags `bench_cost` and `bench_decode` share, with their defaults."""
    parser.add_argument("--vocab-size", type=int, default=2048)
    parser.add_argument("--head-dim", type=int, default=32)
    parser.add_argument("--gqa-groups", type=int, default=1, help="query heads per kv head (default 1: MHA)")
    parser.add_argument("--variants", nargs="+", default=DEFAULT_VARIANTS)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--repeats", type=int, default=5, help="interleaved timings per round (default 5)")
    parser.add_argument("--rounds", type=int, default=5, help="rounds; ratios are medians over rounds (default 5)")


#: The variants every cost report covers, next to Llama.
DEFAULT_VARIANTS = ["identity", "constant", "learnable", "learnable_plus", "sparse", "dense", "svformer", "neutreno"]
#: What the timing part measures per size and sequence length.
METRICS = ("step", "memory", "prefill", "decode")
#: A second Llama, identical to the first, timed like the variants: its ratio is the run's noise floor.
CONTROL = "llama, again"
