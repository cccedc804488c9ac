"""The quickstart as a library: the workflow behind `resformer-quickstart`, callable without the command line.

`run_quickstart(QuickstartSettings(...))` builds (or takes) a Llama checkpoint, converts it with
`convert_llama_checkpoint`, fine-tunes it with the stock `transformers.Trainer` on the bundled public-domain English
sample (or text files / a `datasets` dataset), generates a sample and writes a Hub-ready folder; the steps are in
`steps`, the order and the checks in `workflow`. The command is `resformer_hf.cli.quickstart`.
"""

from __future__ import annotations

from ..text import SAMPLE_DESCRIPTION
from .steps import (
    SAMPLING,
    SMALL_LLAMA,
    QuickstartError,
    TrainingResult,
    TrainingText,
    build_small_llama,
    check_model_fits,
    check_model_reachable,
    fine_tune,
    generate_sample,
    group_into_blocks,
    load_texts,
    load_tokenizer,
)
from .workflow import DEFAULT_OUTPUT, QuickstartOutcome, QuickstartSettings, run_quickstart

__all__ = [
    "DEFAULT_OUTPUT",
    "SAMPLE_DESCRIPTION",
    "SAMPLING",
    "SMALL_LLAMA",
    "QuickstartError",
    "QuickstartOutcome",
    "QuickstartSettings",
    "TrainingResult",
    "TrainingText",
    "build_small_llama",
    "check_model_fits",
    "check_model_reachable",
    "fine_tune",
    "generate_sample",
    "group_into_blocks",
    "load_texts",
    "load_tokenizer",
    "run_quickstart",
]
