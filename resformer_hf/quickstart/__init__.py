"""The quickstart as a library: the workflow behind `resformer-quickstart`, callable without the command line.

`run_quickstart(QuickstartSettings(...))` builds (or takes) a Llama checkpoint, converts it with
`convert_llama_checkpoint`, fine-tunes it with the stock `transformers.Trainer` on the bundled public-domain English
sample (or text files / a `datasets` dataset), generates a sample and writes a Hub-ready folder; the steps are in
`steps`, the order and the checks in `workflow`, and this package exports what those two modules export. The command
is `resformer_hf.cli.quickstart`.
"""

from __future__ import annotations

from ..text import SAMPLE_DESCRIPTION
from . import steps, workflow
from .steps import *  # noqa: F403  (the names in steps.__all__)
from .workflow import *  # noqa: F403  (the names in workflow.__all__)

__all__ = ["SAMPLE_DESCRIPTION"]
__all__ += steps.__all__
__all__ += workflow.__all__
