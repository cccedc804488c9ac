"""The pre-training comparison's text: the Python source files of the running interpreter's own installation
(its standard library and every installed package), which any machine that runs the comparison holds, offline.

Files are deduplicated by content and ordered by the SHA-256 of their bytes, not by path, so the order, the split
(a file is held out when its digest falls in the first `held_out` of the digest space) and which files fill the
training budget depend only on what the files hold: `corpus_digest` names the set and its split exactly, and the
manifest (`corpus-files.tsv.gz` beside the results: digest, bytes, split, whether the run read it, path) lists them.
A byte-level BPE is trained on the first `tokenizer_chars` characters of the training split; the training split is
tokenized in digest order until it covers the budget (each file followed by EOS) and packed into blocks; validation
scores evenly spaced blocks of the held-out files. Tokenizer and blocks are cached in the work folder under a key of
all of this, so a resumed run on the same machine skips them.
"""

from __future__ import annotations

import gzip
import hashlib
import io
import json
import os
import sysconfig
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from resformer_hf.text import pack_blocks

from benchmarks.studies.data import Data, cached_tokenizer

#: Files over this size are left out: generated tables more than code.
MAX_FILE_BYTES = 1_000_000
#: Files given at a time to the tokenizer's (parallel) batch encoder.
ENCODE_CHUNK = 512


@dataclass(frozen=True)
class Source:
    sha: str
    text: str
    path: Path
    size: int  #: bytes

    def held_out(self, fraction: float) -> bool:
        return int(self.sha[:8], 16) < fraction * 16**8


def installation_roots() -> list[Path]:
    """The interpreter's standard library and package folders, each walked once (site-packages often lies inside
    the standard library's folder)."""
    paths = sysconfig.get_paths()
    found = {Path(paths[key]).resolve() for key in ("stdlib", "platstdlib", "purelib", "platlib") if key in paths}
    return sorted(root for root in found if root.is_dir() and not any(other in root.parents for other in found))


def collect(roots: list[Path]) -> tuple[list[Source], dict[str, int]]:
    """Every `*.py` file under `roots` once per content, in digest order, and how many were left out and why."""
    by_sha: dict[str, Source] = {}
    left_out = {"duplicates": 0, "links": 0, "too_large": 0, "not_utf8": 0}
    for root in roots:
        for folder, subfolders, files in os.walk(root):  # links to folders are not followed
            subfolders.sort()
            for name in sorted(name for name in files if name.endswith(".py")):
                path = Path(folder, name)
                if path.is_symlink() or not path.is_file():
                    left_out["links"] += 1
                    continue
                data = path.read_bytes()
                if len(data) > MAX_FILE_BYTES:
                    left_out["too_large"] += 1
                    continue
                try:
                    text = data.decode("utf-8")
                except UnicodeDecodeError:
                    left_out["not_utf8"] += 1
                    continue
                sha = hashlib.sha256(data).hexdigest()
                if sha in by_sha:
                    left_out["duplicates"] += 1
                    continue
                by_sha[sha] = Source(sha, text, path, len(data))
    if not by_sha:
        raise SystemExit(f"no Python source files under {', '.join(map(str, roots))}")
    return [by_sha[sha] for sha in sorted(by_sha)], left_out


def corpus_digest(sources: list[Source], held_out: float) -> str:
    """The exact set of files and their split: SHA-256 over `<file digest> <split>` lines in digest order."""
    lines = "".join(f"{s.sha} {'held-out' if s.held_out(held_out) else 'train'}\n" for s in sources)
    return hashlib.sha256(lines.encode()).hexdigest()


def tokenizer_digest(tokenizer) -> str:
    """SHA-256 of the tokenizer's model (vocabulary and merges), the same trained or loaded back from disk."""
    model = json.loads(tokenizer.backend_tokenizer.to_str())["model"]
    return hashlib.sha256(json.dumps(model, sort_keys=True).encode()).hexdigest()


def encode(tokenizer, texts: list[str]) -> list[np.ndarray]:
    """Each text's token ids (no special tokens) followed by EOS, encoded in parallel by the Rust tokenizer (give it
    a chunk of texts at a time: its encodings of a whole corpus would not fit in memory)."""
    eos = tokenizer.eos_token_id
    encoded = tokenizer.backend_tokenizer.encode_batch_fast(texts, add_special_tokens=False)
    return [np.asarray([*item.ids, eos], dtype=np.int32) for item in encoded]


def tokenize_until(tokenizer, texts: list[str], tokens: int) -> tuple[np.ndarray, int]:
    """The stream of `texts` in order, cut after the text that brings it to `tokens` (all of them if fewer), and how
    many texts it read."""
    parts, total = [], 0
    for start in range(0, len(texts), ENCODE_CHUNK):
        for ids in encode(tokenizer, texts[start : start + ENCODE_CHUNK]):
            parts.append(ids)
            total += len(ids)
            if total >= tokens:
                return np.concatenate(parts), len(parts)
    return np.concatenate(parts), len(parts)


def build(roots: list[Path], work: Path, *, vocab_size: int, held_out: float, tokenizer_chars: int, seq_len: int,
          train_tokens: int, val_tokens: int, manifest: Path | None = None) -> tuple[Data, dict]:
    """The tokenizer and the packed blocks (cached in `work`), and the facts a run records about them."""
    sources, left_out = collect(roots)
    train = [s for s in sources if not s.held_out(held_out)]
    val = [s for s in sources if s.held_out(held_out)]
    if not train or not val:
        raise SystemExit(f"{len(sources)} files give {len(train)} training and {len(val)} held-out files at "
                         f"held-out fraction {held_out}: both splits need files (use a larger corpus)")
    digest = corpus_digest(sources, held_out)
    settings = dict(vocab_size=vocab_size, held_out=held_out, tokenizer_chars=tokenizer_chars, seq_len=seq_len,
                    train_tokens=train_tokens, val_tokens=val_tokens)
    key = hashlib.sha256(json.dumps([digest, settings], sort_keys=True).encode()).hexdigest()[:16]
    folder = Path(work) / f"data-{key}"
    sample, chars = [], 0
    for source in train:
        if chars >= tokenizer_chars:
            break
        sample.append(source.text)
        chars += len(source.text)
    tokenizer = cached_tokenizer(sample, vocab_size, folder)
    if (folder / "blocks.pt").is_file():
        cached = torch.load(folder / "blocks.pt")
    else:
        stream, read = tokenize_until(tokenizer, [s.text for s in train], train_tokens + seq_len)
        val_stream, _ = tokenize_until(tokenizer, [s.text for s in val], np.iinfo(np.int64).max)
        cached = {"train": pack_blocks(torch.from_numpy(stream).long(), seq_len),
                  "val": pack_blocks(torch.from_numpy(val_stream).long(), seq_len), "read": read}
        torch.save(cached, folder / "blocks.tmp")
        os.replace(folder / "blocks.tmp", folder / "blocks.pt")
    train_blocks, val_blocks = cached["train"], cached["val"]
    if len(val_blocks) == 0:
        raise SystemExit(f"the held-out files hold fewer than {seq_len} tokens: no validation block")
    if val_tokens and len(val_blocks) * seq_len > val_tokens:
        keep = max(1, val_tokens // seq_len)
        val_blocks = val_blocks[torch.linspace(0, len(val_blocks) - 1, keep).round().long()]
    if manifest is not None:
        write_manifest(manifest, sources, held_out, {s.sha for s in train[: cached["read"]]})
    facts = dict(
        corpus_digest=digest, tokenizer_digest=tokenizer_digest(tokenizer),
        roots=[str(root) for root in roots], files=len(sources), left_out=left_out, train_files=len(train),
        held_out_files=len(val), train_files_read=cached["read"], bytes=sum(s.size for s in sources),
        tokenizer_files=len(sample), train_tokens_read=train_blocks.numel(), val_tokens_scored=val_blocks.numel(),
        **settings)
    return Data(tokenizer, train_blocks, val_blocks), facts


def write_manifest(path: Path, sources: list[Source], held_out: float, read: set[str]) -> None:
    """`digest  bytes  split  read  path`, one file a line in digest order, gzipped (no timestamp: the same files
    give the same bytes)."""
    with gzip.GzipFile(path, "wb", mtime=0) as packed, io.TextIOWrapper(packed, encoding="utf-8") as handle:
        handle.write("sha256\tbytes\tsplit\tread\tpath\n")
        for s in sources:
            split = "held-out" if s.held_out(held_out) else "train"
            handle.write(f"{s.sha}\t{s.size}\t{split}\t{int(s.sha in read)}\t{s.path}\n")
