#!/usr/bin/env python
"""Convert a checkpoint (Llama, Qwen, Gemma 3, ...) to ResFormer.

`python conversion/convert_llama_to_resformer.py SRC DST [options]`.

A thin wrapper around the installed console command `resformer-convert` (`resformer_hf.cli.convert`); see `--help`.
"""

import sys

from resformer_hf.cli.convert import main

if __name__ == "__main__":
    sys.exit(main())
