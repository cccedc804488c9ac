"""The paper's headline at CPU scale: from-scratch pre-training of Llama vs ResFormer variants on the same tokens.

Every model sees the same BPE tokenizer (trained on the training split only), the same initial seed, the same batches
in the same order and the same token budget; validation loss is measured on a fixed held-out tail of each corpus
file. Reports loss curves, final losses and the paper's metric: how many fewer training tokens a variant needs to
reach Llama's final validation loss (linear interpolation along the variant's curve).

    python benchmarks/bench_pretrain.py                      # default: ~30 min on 2 idle CPU cores
    python benchmarks/bench_pretrain.py --tokens 200000      # quick smoke run
    python benchmarks/bench_pretrain.py --device cuda --hidden-size 512 --layers 8 --tokens 100000000
    python benchmarks/bench_pretrain.py --report-only        # redraw table/plot from results/pretrain.json

Results are saved after every model, and a rerun with the same flags skips the models already in `pretrain.json`
(pass `--fresh` to start over), so an interrupted run on a busy machine loses at most one model.

Writes `benchmarks/results/pretrain.{json,md,png}` and `pretrain_analysis.png`.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import sys
import tempfile
import time
from pathlib import Path

import torch
from transformers import get_cosine_with_min_lr_schedule_with_warmup

from resformer_hf.analysis import attention_entropy, lambda_table, token_similarity
from resformer_hf.text import pack_blocks, split_documents, token_stream, train_tokenizer

from common import (
    BASELINE,
    REPO_ROOT,
    RESULTS_DIR,
    add_device_args,
    build_model,
    environment_line,
    markdown_table,
    pyplot,
    setup_device,
)

DEFAULT_VARIANTS = [BASELINE, "identity", "learnable", "learnable_plus", "sparse", "svformer", "neutreno"]
DEFAULT_CORPUS = REPO_ROOT.parent / "shared" / "data" / "corpus"


# ---- data ----------------------------------------------------------------------------------------------------------


def read_corpus(corpus_dir: Path) -> list[str]:
    """Every `*.txt` document of the corpus folder, in name order."""
    files = sorted(corpus_dir.glob("*.txt"))
    if not files:
        raise SystemExit(f"no *.txt files in {corpus_dir}; pass --corpus-dir pointing at plain-text files.")
    return [path.read_text(encoding="utf-8") for path in files]


def cached_tokenizer(train_texts: list[str], vocab_size: int, cache: Path | None):
    """The text pipeline's byte-level BPE, trained on the training split only and cached for resumed runs."""
    from transformers import AutoTokenizer

    if cache is not None and (cache / "tokenizer.json").is_file():
        return AutoTokenizer.from_pretrained(cache)
    tokenizer = train_tokenizer(train_texts, vocab_size)
    if cache is not None:
        tokenizer.save_pretrained(cache)
    return tokenizer


def batch_order(num_sequences: int, batch_size: int, steps: int, seed: int) -> torch.Tensor:
    """[steps, batch_size] sequence indices: a seeded shuffle per epoch, identical for every variant."""
    generator = torch.Generator().manual_seed(seed)
    needed = steps * batch_size
    epochs = math.ceil(needed / num_sequences)
    order = torch.cat([torch.randperm(num_sequences, generator=generator) for _ in range(epochs)])
    return order[:needed].view(steps, batch_size)


# ---- training --------------------------------------------------------------------------------------------------


@torch.no_grad()
def validation_loss(model, val: torch.Tensor, batch_size: int, device: torch.device) -> float:
    """Token-weighted mean next-token loss over every held-out window."""
    model.eval()
    total, count = 0.0, 0
    for start in range(0, len(val), batch_size):
        batch = val[start : start + batch_size].to(device)
        loss = model(input_ids=batch, labels=batch, use_cache=False).loss
        tokens = batch.numel() - batch.shape[0]
        total += float(loss) * tokens
        count += tokens
    model.train()
    return total / count


def parameter_groups(model, weight_decay: float):
    """Decay matrices only (norm gains and the λ offsets stay undecayed), as in common LM recipes."""
    decay = [p for p in model.parameters() if p.ndim >= 2]
    rest = [p for p in model.parameters() if p.ndim < 2]
    return [{"params": decay, "weight_decay": weight_decay}, {"params": rest, "weight_decay": 0.0}]


def train_variant(variant: str, size: dict, args, train: torch.Tensor, val: torch.Tensor, order: torch.Tensor,
                  device: torch.device) -> dict:
    torch.manual_seed(args.seed)
    model = build_model(variant, device, **size)
    model.train()
    optimizer = torch.optim.AdamW(parameter_groups(model, args.weight_decay), lr=args.lr, betas=(0.9, 0.95))
    steps = len(order)
    scheduler = get_cosine_with_min_lr_schedule_with_warmup(
        optimizer, num_warmup_steps=max(1, int(args.warmup * steps)), num_training_steps=steps, min_lr_rate=0.1
    )
    tokens_per_step = args.batch_size * args.seq_len
    curve = [(0, validation_loss(model, val, args.batch_size * 2, device))]
    train_losses = []
    seconds = 0.0  # training only: evaluation time is excluded so the time ratio compares steps
    for step in range(1, steps + 1):
        start = time.perf_counter()
        batch = train[order[step - 1]].to(device)
        loss = model(input_ids=batch, labels=batch, use_cache=False).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        train_losses.append(float(loss.detach()))
        seconds += time.perf_counter() - start
        if step % args.eval_every == 0 or step == steps:
            curve.append((step * tokens_per_step, validation_loss(model, val, args.batch_size * 2, device)))
            recent = sum(train_losses[-args.eval_every :]) / len(train_losses[-args.eval_every :])
            print(f"  {variant:>15} step {step:5d}/{steps}  train {recent:.4f}  val {curve[-1][1]:.4f}  "
                  f"{seconds:.0f}s", flush=True)
    model.eval()
    probe = val[: args.analysis_sequences].to(device)
    result = {
        "variant": variant,
        "curve": curve,
        "final_val_loss": curve[-1][1],
        "train_seconds": seconds,
        "attention_entropy": attention_entropy(model, probe).tolist(),
        "token_similarity": token_similarity(model, probe).tolist(),
        "lambdas": lambda_table(model).tolist(),
        "parameters": sum(p.numel() for p in model.parameters()),
    }
    if args.save_dir:
        model.save_pretrained(Path(args.save_dir) / variant)
    return result


# ---- report ------------------------------------------------------------------------------------------------------


def tokens_to_reach(curve: list[tuple[int, float]], target: float) -> float | None:
    """Training tokens at which the validation curve first reaches `target`, interpolated linearly; None if never."""
    for (t0, l0), (t1, l1) in zip(curve, curve[1:]):
        if l1 <= target:
            if l0 <= target:
                return float(t0)
            return t0 + (t1 - t0) * (l0 - target) / (l0 - l1)
    return None


def write_report(payload: dict, out_dir: Path) -> None:
    results = {r["variant"]: r for r in payload["results"]}
    if BASELINE not in results:
        raise SystemExit(f"the report needs the {BASELINE!r} baseline among --variants")
    base = results[BASELINE]
    target = base["final_val_loss"]
    budget = base["curve"][-1][0]
    rows = []
    for name, r in results.items():
        reached = tokens_to_reach(r["curve"], target)
        if name == BASELINE:
            saving = "—"
        else:
            saving = "not reached" if reached is None else f"{100 * (1 - reached / budget):.1f}%"
        rows.append([
            f"`{name}`",
            f"{r['final_val_loss']:.4f}",
            f"{r['final_val_loss'] - target:+.4f}",
            "—" if reached is None else f"{reached / 1e6:.3f}M",
            saving,
            f"{r['train_seconds'] / base['train_seconds']:.2f}",
            f"{sum(r['attention_entropy']) / len(r['attention_entropy']):.3f}",
            f"{r['token_similarity'][-2]:.3f}",
        ])
    best = min((r for n, r in results.items() if n != BASELINE), key=lambda r: r["final_val_loss"], default=None)
    cfg = payload["config"]
    lines = [
        "# Pre-training: Llama vs value-residual variants (CPU scale)",
        f"Regenerate: `{payload.get('command', 'python benchmarks/bench_pretrain.py')}`. " + payload["environment"],
        f"Model: hidden {cfg['hidden_size']}, {cfg['layers']} layers, {cfg['heads']} heads, intermediate "
        f"{cfg['intermediate_size']}, vocab {cfg['vocab_size']} (byte-level BPE trained on the training split), "
        f"context {cfg['seq_len']}; {payload['steps']} AdamW steps × {cfg['batch_size']} sequences = "
        f"{budget / 1e6:.2f}M training tokens per model, lr {cfg['lr']} (warmup {cfg['warmup']:.0%}, cosine to 10%), "
        f"weight decay {cfg['weight_decay']}, seed {cfg['seed']}; validation loss every "
        f"{cfg.get('eval_every', '?')} steps "
        f"on {payload['val_tokens'] / 1e3:.0f}k tokens: fixed, evenly spaced windows of the held-out last "
        f"{cfg['val_fraction']:.0%} of each corpus file.",
        "",
        markdown_table(
            ["model", "final val loss", "Δ vs Llama", "tokens to reach Llama's final loss", "fewer tokens than Llama",
             "train time ratio", "mean attention entropy", "token similarity (last layer)"],
            rows,
        ),
        "",
        "*fewer tokens than Llama* is the paper's metric (20.3% at 82M–468M parameters): "
        "`1 − tokens_to_reach / budget`,"
        " interpolating linearly between evaluations. Train time ratios are wall-clock on a shared machine (noisy).",
    ]
    if best is not None:
        lines += ["", f"Lowest final validation loss: `{best['variant']}` ({best['final_val_loss']:.4f} vs Llama "
                      f"{target:.4f})."]
    learned = {n: r["lambdas"] for n, r in results.items() if n in ("learnable", "learnable_plus")}
    if learned:
        layers = len(next(iter(learned.values())))
        lines += ["", "Learned (λ_first, λ_self) per layer after training:", "", markdown_table(
            ["model"] + [str(i) for i in range(layers)],
            [[f"`{n}`"] + [f"{a:.2f}, {b:.2f}" for a, b in table] for n, table in learned.items()],
        )]
    lines += ["", "![validation loss](pretrain.png)", "", "![analysis](pretrain_analysis.png)", ""]
    (out_dir / "pretrain.md").write_text("\n".join(lines))
    plot(results, out_dir, target)


def plot(results: dict, out_dir: Path, target: float) -> None:
    plt = pyplot()
    figure, (left, right) = plt.subplots(1, 2, figsize=(12, 4.5))
    base = dict(results[BASELINE]["curve"])
    for index, (name, r) in enumerate(results.items()):
        tokens = [t / 1e6 for t, _ in r["curve"][1:]]
        losses = [loss for _, loss in r["curve"][1:]]
        style = dict(color="black", lw=2) if name == BASELINE else dict(color=f"C{index}")
        left.plot(tokens, losses, label=name, **style)
        right.plot(tokens, [loss - base[t] for t, loss in r["curve"][1:]], label=name, **style)
    left.axhline(target, color="grey", ls=":", lw=1)
    lows = [loss for r in results.values() for _, loss in r["curve"][1:]]
    left.set_ylim(min(lows) - 0.05, min(lows) + 1.5)
    left.set(xlabel="training tokens (M)", ylabel="validation loss", title="Validation loss")
    right.set(xlabel="training tokens (M)", ylabel="val loss − Llama val loss", title="Difference to Llama")
    for axes in (left, right):
        axes.grid(alpha=0.3)
        axes.legend(fontsize="small")
    figure.tight_layout()
    figure.savefig(out_dir / "pretrain.png", dpi=120)
    plt.close(figure)

    figure, (left, right) = plt.subplots(1, 2, figsize=(12, 4.5))
    for index, (name, r) in enumerate(results.items()):
        style = dict(color="black", lw=2) if name == BASELINE else dict(color=f"C{index}")
        left.plot(range(len(r["attention_entropy"])), r["attention_entropy"], marker="o", label=name, **style)
        right.plot(range(len(r["token_similarity"])), r["token_similarity"], marker="o", label=name, **style)
    left.set(xlabel="layer", ylabel="mean attention entropy (nats)", title="Attention entropy after training")
    right.set(xlabel="hidden state (0 = embeddings)", ylabel="mean pairwise cosine", title="Token similarity")
    for axes in (left, right):
        axes.grid(alpha=0.3)
        axes.legend(fontsize="small")
    figure.tight_layout()
    figure.savefig(out_dir / "pretrain_analysis.png", dpi=120)
    plt.close(figure)


# ---- main ----------------------------------------------------------------------------------------------------------


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_device_args(parser)
    parser.add_argument("--variants", nargs="+", default=DEFAULT_VARIANTS, help="'llama' and value_residual variants")
    parser.add_argument("--corpus-dir", type=Path, default=DEFAULT_CORPUS, help="folder of *.txt training text")
    parser.add_argument("--val-fraction", type=float, default=0.02, help="held-out tail of each file (default 0.02)")
    parser.add_argument("--vocab-size", type=int, default=2048)
    parser.add_argument("--hidden-size", type=int, default=128)
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--kv-heads", type=int, default=None, help="default: --heads (multi-head attention)")
    parser.add_argument("--intermediate-size", type=int, default=None, help="default: 8/3 hidden, multiple of 32")
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--tokens", type=int, default=1_600_000, help="training tokens per model (default 1.6M)")
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--warmup", type=float, default=0.05, help="warmup fraction of the steps")
    parser.add_argument("--weight-decay", type=float, default=0.1)
    parser.add_argument("--val-tokens", type=int, default=32768,
                        help="held-out tokens scored per evaluation: evenly spaced windows of the tail "
                        "(default 32768)")
    parser.add_argument("--eval-every", type=int, default=50, help="steps between validation evaluations")
    parser.add_argument("--analysis-sequences", type=int, default=8, help="validation windows for entropy/similarity")
    parser.add_argument("--save-dir", default=None, help="also save every trained model here (not committed)")
    parser.add_argument("--out", type=Path, default=RESULTS_DIR, help="results folder")
    parser.add_argument("--fresh", action="store_true", help="ignore models already in <out>/pretrain.json")
    parser.add_argument("--report-only", action="store_true", help="rebuild md/png from <out>/pretrain.json")
    return parser.parse_args(argv)


def main(argv=None) -> None:
    args = parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    if args.report_only:
        write_report(json.loads((args.out / "pretrain.json").read_text()), args.out)
        return
    device = setup_device(args)
    intermediate = args.intermediate_size or max(32, round(args.hidden_size * 8 / 3 / 32) * 32)
    train_texts, val_texts = split_documents(read_corpus(args.corpus_dir), args.val_fraction)
    key = hashlib.sha1(f"{args.corpus_dir.resolve()}|{args.vocab_size}|{args.val_fraction}".encode()).hexdigest()[:12]
    cache = Path(tempfile.gettempdir()) / f"resformer-bench-pretrain-tokenizer-{key}"  # reused by resumed runs
    tokenizer = cached_tokenizer(train_texts, args.vocab_size, None if args.fresh else cache)
    train = pack_blocks(token_stream(tokenizer, train_texts), args.seq_len)
    val = pack_blocks(token_stream(tokenizer, val_texts), args.seq_len)
    if args.val_tokens and len(val) * args.seq_len > args.val_tokens:  # a fixed, evenly spaced subset of the tail
        keep = max(1, args.val_tokens // args.seq_len)
        val = val[torch.linspace(0, len(val) - 1, keep).round().long()]
    steps = max(1, args.tokens // (args.batch_size * args.seq_len))
    order = batch_order(len(train), args.batch_size, steps, args.seed)
    print(f"{train.numel() / 1e6:.2f}M training tokens, {val.numel() / 1e3:.0f}k validation tokens, {steps} steps")
    size = dict(
        vocab_size=len(tokenizer), hidden_size=args.hidden_size, intermediate_size=intermediate,
        num_hidden_layers=args.layers, num_attention_heads=args.heads, num_key_value_heads=args.kv_heads or args.heads,
        max_position_embeddings=args.seq_len, tie_word_embeddings=True,
        pad_token_id=tokenizer.pad_token_id, bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
    )
    if args.save_dir:
        tokenizer.save_pretrained(Path(args.save_dir) / "tokenizer")
    payload = {
        "config": {
            "hidden_size": args.hidden_size, "layers": args.layers, "heads": args.heads, "kv_heads": args.kv_heads
            or args.heads, "intermediate_size": intermediate, "vocab_size": len(tokenizer),
            "seq_len": args.seq_len, "batch_size": args.batch_size, "lr": args.lr, "warmup": args.warmup,
            "weight_decay": args.weight_decay, "seed": args.seed, "val_fraction": args.val_fraction,
            "eval_every": args.eval_every,
        },
        "steps": steps,
        "val_tokens": val.numel(),
        "environment": environment_line(device),
        "command": " ".join(["python benchmarks/bench_pretrain.py", *(sys.argv[1:] if argv is None else argv)]),
        "results": [],
    }
    saved = args.out / "pretrain.json"
    if saved.is_file() and not args.fresh:
        previous = json.loads(saved.read_text())
        if {k: previous.get(k) for k in ("config", "steps", "val_tokens")} == {
            k: payload[k] for k in ("config", "steps", "val_tokens")
        }:
            payload["results"] = [r for r in previous["results"] if r["variant"] in args.variants]
    done = {r["variant"] for r in payload["results"]}
    for variant in args.variants:
        if variant in done:
            print(f"{variant}: already in {saved}, skipped (--fresh retrains)", flush=True)
            continue
        print(f"training {variant}", flush=True)
        payload["results"].append(train_variant(variant, size, args, train, val, order, device))
        payload["results"].sort(key=lambda r: args.variants.index(r["variant"]))
        saved.write_text(json.dumps(payload, indent=1))
    if any(r["variant"] == BASELINE for r in payload["results"]):
        write_report(payload, args.out)
        print(f"wrote {args.out / 'pretrain.md'}")


if __name__ == "__main__":
    main()
