"""One module per kind of report a study can declare (`Study.report`); each has `render(results) -> Path | None`,
which writes `<out>/<study>.md` and its plots from the study's stored runs."""

from __future__ import annotations

import importlib
from pathlib import Path

#: report kind → module (under `benchmarks.studies.reports`) that renders it
RENDERERS = {
    "seeds": "seeds",  # per-arm seed summary, per-seed losses, learned λ (pretrain)
    "contexts": "contexts",  # the seed summary per context (context_length)
    "tuned": "tuned",  # final loss per learning rate, each arm at its best vs Llama at its best (lr_sweep, ...)
    "paired": "paired",  # per corpus and arm, Δ vs Llama over every seed, and each seed's λ (tuned_seeds)
    "baselines": "baselines",  # quality at Llama's cache and loss vs KV-cache bytes (baselines)
    "sizes": "sizes",  # loss vs non-embedding parameters, fitted (param_efficiency)
    "kv_cache": "kv_cache",  # measured cache bytes and loss vs the equal-cache Llama (svformer_gqa)
    "uptrain": "uptrain",  # converted checkpoints continued vs the continued Llama (uptrain)
}


def render(results) -> Path | None:
    kind = results.study.report
    if kind not in RENDERERS:
        raise SystemExit(f"study {results.study.name} declares report {kind!r}; the kinds: {', '.join(RENDERERS)}")
    results.out.mkdir(parents=True, exist_ok=True)
    return importlib.import_module(f"{__name__}.{RENDERERS[kind]}").render(results)
