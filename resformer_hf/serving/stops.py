"""OpenAI's `stop` in `resformer-serve`, with and without continuous batching.

OpenAI's API ends a completion at the first stop string and leaves it out of the text (`finish_reason` "stop"),
streaming included. `transformers serve` (5.19 to 5.24) hands `stop` to `generate()` as `stop_strings`, which ends
generation after the token that completes one but keeps it (and what that token holds beyond it) in the text; its
continuous batching ignores it, generating up to `max_tokens`. Here, for both engines: the text is cut before the
first stop string (the first one completed); a stream holds back text that could be the start of one; generation is
cancelled as soon as one is complete (continuous batching included); and the generated tokens counted (usage,
log-probabilities) end with the token that completed it, as OpenAI's and vLLM's do.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any

#: Most stop strings a request may give. OpenAI's API takes 4; lm-eval's tasks send their `until` list plus the EOS
#: string, which can be more, and vLLM takes any number.
MAX_STOPS = 16


def stop_problem(body: dict) -> str | None:
    """The message of a 400 for a `stop` that is not a non-empty string or a list of them, or None."""
    stop = body.get("stop")
    if stop is None:
        return None
    stops = [stop] if isinstance(stop, str) else stop
    if not isinstance(stops, list) or not all(isinstance(item, str) and item for item in stops):
        return f"stop must be a non-empty string or a list of non-empty strings, got {str(stop)[:100]!r}"
    if len(stops) > MAX_STOPS:
        return f"stop takes at most {MAX_STOPS} strings, got {len(stops)}"
    return None


def stop_strings(value: Any) -> list[str]:
    """The stop strings of a request's `stop` (or a generation config's `stop_strings`): a list, maybe empty."""
    if not value:
        return []
    return [value] if isinstance(value, str) else [item for item in value if item]


def first_stop(text: str, stops: Sequence[str]) -> int | None:
    """Where the stop string that `text` completes first starts (of two completed by one character, the one listed
    first: "gh" with stops ["h", "gh"] ends the text before "h", as vLLM, and lm-eval cutting its `until` strings in
    turn, do), or None."""
    found = [(index + len(stop), order, index) for order, (stop, index) in enumerate((stop, text.find(stop))
                                                                                      for stop in stops) if index >= 0]
    return min(found)[2] if found else None


def held_back(text: str, stops: Sequence[str]) -> int:
    """How many characters at the end of `text` could be the start of a stop string (a stream holds them back)."""
    longest = 0
    for stop in stops:
        for size in range(min(len(stop) - 1, len(text)), longest, -1):
            if stop.startswith(text[len(text) - size:]):
                longest = size
                break
    return longest


class StopWatch:
    """Decodes generated tokens as they come (as the server's streamers do) and says after which token the text
    first holds a stop string."""

    def __init__(self, tokenizer: Any, stops: Sequence[str]) -> None:
        from tokenizers.decoders import DecodeStream

        self._rust = getattr(tokenizer, "tokenizer", tokenizer)._tokenizer
        self._stream = DecodeStream([], skip_special_tokens=True)
        self.stops = list(stops)
        self.text = ""
        self.seen = 0

    def feed(self, tokens: Sequence[int]) -> int | None:
        """`tokens`: all generated so far (the ones not fed yet are read). The number of tokens up to and including
        the one that completed a stop string, or None."""
        for token in list(tokens)[self.seen:]:
            self.seen += 1
            piece = self._stream.step(self._rust, int(token))
            if piece:
                self.text += piece
                if first_stop(self.text, self.stops) is not None:
                    return self.seen
        return None


def cut_at_stop(tokenizer: Any, text: str, ids: Sequence[int], stops: Sequence[str]) -> tuple[str, int] | None:
    """(the text before the first stop string, the tokens up to the one that completed it), or None if `text` (the
    decoded `ids`) holds none."""
    index = first_stop(text, stops)
    if index is None:
        return None
    kept = StopWatch(tokenizer, stops).feed(ids)
    return text[:index], len(ids) if kept is None else kept


def stopping_queue(queue: asyncio.Queue, streamer: Any, stops: Sequence[str]) -> asyncio.Queue:
    """A queue of the server's streamed text (`queue`, ended by None) without the first stop string and what follows
    it; text that could start a stop string is held back until it cannot. When a stop string is complete, the stream
    ends and `streamer`'s generation is cancelled. Items that are not plain text (a failure, a parser's events) are
    passed on as they come."""
    out: asyncio.Queue = asyncio.Queue()

    async def pump() -> None:
        held = ""
        while True:
            item = await queue.get()
            if type(item) is not str:
                if held:
                    out.put_nowait(held)
                    held = ""
                out.put_nowait(item)
                if item is None or type(item).__name__ == "_StreamError":
                    return
                continue
            held += item
            index = first_stop(held, stops)
            if index is not None:
                if index:
                    out.put_nowait(held[:index])
                streamer.cancel()
                streamer.stopped = True
                out.put_nowait(None)
                return
            safe = len(held) - held_back(held, stops)
            if safe:
                out.put_nowait(held[:safe])
                held = held[safe:]

    out.pump = asyncio.get_running_loop().create_task(pump())  # keep a reference: the loop holds tasks weakly
    return out


__all__ = ["MAX_STOPS", "StopWatch", "cut_at_stop", "first_stop", "held_back", "stop_problem", "stop_strings",
           "stopping_queue"]
