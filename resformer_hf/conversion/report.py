"""What a conversion tells its caller: `ConversionError` for what the user can fix, `ConversionReport` when done."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from ..errors import UserInputError

#: Shape of the seeded probe batch on which source and converted logits are compared.
PROBE_SHAPE = (2, 16)


class ConversionError(UserInputError):
    """A problem with the user's input or environment; the message is one line that says what to do."""


@dataclass
class ConversionReport:
    """What a conversion did, for printing and for callers that chain steps (quickstart, tests)."""

    dst: Path
    src: str
    variant: str
    init: str
    source_model_type: str
    num_tensors: int
    num_shards: int
    total_bytes: int
    dtype: str
    added_tensors: list[str] = field(default_factory=list)
    dropped_tensors: list[str] = field(default_factory=list)
    copied_files: list[str] = field(default_factory=list)
    max_abs_logit_diff: float | None = None
    notes: list[str] = field(default_factory=list)
    seconds: float = 0.0

    def summary(self) -> str:
        """A few human-readable lines, as the CLI prints them."""
        lines = [
            f"Converted {self.src} ({self.source_model_type}) -> {self.dst}",
            f"  variant={self.variant} init={self.init} dtype={self.dtype}: {self.num_tensors} tensors in "
            f"{self.num_shards} shard(s), {self.total_bytes / 2**20:.1f} MiB, {self.seconds:.1f} s",
        ]
        if self.added_tensors:
            lines.append(f"  added {len(self.added_tensors)} tensor(s): {short_list(self.added_tensors)}")
        if self.dropped_tensors:
            lines.append(f"  dropped {len(self.dropped_tensors)} tensor(s): {short_list(self.dropped_tensors)}")
        if self.max_abs_logit_diff is not None:
            lines.append(f"  max |Δ logits| vs the source on a {PROBE_SHAPE[0]}x{PROBE_SHAPE[1]} probe batch: "
                         f"{self.max_abs_logit_diff:.3g}")
        lines.extend(f"  note: {note}" for note in self.notes)
        return "\n".join(lines)


def short_list(names: list[str], limit: int = 3) -> str:
    """The first few names and how many more."""
    shown = ", ".join(str(name) for name in names[:limit])
    return shown + (f" (+{len(names) - limit} more)" if len(names) > limit else "")


__all__ = ["PROBE_SHAPE", "ConversionError", "ConversionReport", "short_list"]
