"""OpenAI's sampling semantics in `resformer-serve`, with and without continuous batching.

`transformers serve` (5.19 to 5.24) samples only if the folder's `generation_config` says `do_sample`, whatever the
request's `temperature`; it seeds the process's random stream when it reads the request, not when the request is
generated (a concurrent request draws from it in between); and its continuous batching builds one engine from the
first request's generation config, so every later request gets that request's sampling, silently. Here:

- a request that sets `temperature` or `top_p` gets OpenAI's sampling: `temperature` 0 is greedy, > 0 samples at that
  temperature from the nucleus `top_p` (1 when not given; `temperature` 1 when only `top_p` is given), with no
  top-k or other filter of the folder's; a request that sets neither gets the folder's `generation_config`;
- `seed` seeds the random stream on the inference thread just before that request is generated (one request at a
  time there), so a seed gives the same text whatever runs beside it;
- with continuous batching, one engine samples every request with its own settings: the engine is built sampling,
  with per-request temperature, top-k and top-p (transformers' `per_request_processors`), and each request passes
  its own (greedy: top-k 1). What one engine cannot do per request (`seed` on a sampled request,
  `frequency_penalty`, `logit_bias`, a `generation_config`) is refused with a 400 by `batching_problem`; a seed on a
  greedy request changes nothing, and is accepted (`stop` is applied to every engine's answers, `stops`).
"""

from __future__ import annotations

import contextvars
import copy
import dataclasses
from typing import Any

import torch

#: Request fields continuous batching cannot honour per request (one engine, one random stream); `seed` only on a
#: request that samples (a greedy one draws nothing).
NOT_PER_REQUEST = ("seed", "frequency_penalty", "logit_bias", "generation_config")
#: The engine's own defaults: any value that makes transformers build the temperature, top-k and top-p processors
#: (1.0, 0 or None would not); every request overrides all three.
ENGINE_SAMPLING = {"temperature": 0.5, "top_k": 50, "top_p": 0.5}

#: The request being handled (each request is handled in a task of its own): its seed, its engine settings.
_seed: contextvars.ContextVar[int | None] = contextvars.ContextVar("resformer_serve_seed", default=None)
_sampling: contextvars.ContextVar[dict | None] = contextvars.ContextVar("resformer_serve_sampling", default=None)


def samples(body: dict, folder_samples: bool = False) -> bool:
    """Whether `body` asks for sampled text: OpenAI's `temperature` > 0 (1 when only `top_p` is given), or the
    folder's `generation_config` (`folder_samples`) when it sets neither."""
    temperature, top_p = body.get("temperature"), body.get("top_p")
    if temperature is None and top_p is None:
        return folder_samples
    return temperature is None or temperature > 0


def batching_problem(body: dict, folder_samples: bool = False) -> str | None:
    """The message of a 400 for a request that a continuous-batching server cannot honour, or None. A `seed` on a
    greedy request (`samples`) is honoured by definition: nothing is drawn."""
    given = [name for name in NOT_PER_REQUEST if body.get(name) is not None
             and (name != "seed" or samples(body, folder_samples))]
    if not given:
        return None
    names = ", ".join(given)
    return (f"{names} cannot be honoured by this server: it runs with continuous batching (--continuous-batching), "
            "where one engine generates every request from one random stream and takes only temperature, top_p "
            f"and max_tokens per request (not {', '.join(NOT_PER_REQUEST)}; a seed only with temperature 0). Drop "
            f"{names}, or start resformer-serve without --continuous-batching.")


def openai_sampling(body: dict, config: Any) -> Any:
    """`config` (a GenerationConfig the server built for `body`) with OpenAI's sampling when `body` sets
    `temperature` or `top_p`; unchanged otherwise (the folder's generation_config decides). Every filter is set
    explicitly: `generate()` fills a field left None from the folder's generation_config, then from its own defaults
    (top-k 50)."""
    temperature, top_p = body.get("temperature"), body.get("top_p")
    if temperature is None and top_p is None:
        return config
    temperature = 1.0 if temperature is None else float(temperature)
    config.do_sample = temperature > 0
    config.temperature = temperature if config.do_sample else 1.0
    config.top_p = 1.0 if top_p is None or not config.do_sample else float(top_p)
    config.top_k, config.min_p, config.typical_p, config.epsilon_cutoff, config.eta_cutoff = 0, 0.0, 1.0, 0.0, 0.0
    return config


def per_request_sampling(config: Any, vocab_size: int) -> dict:
    """The continuous-batching engine's per-request settings (`add_request`'s keyword arguments) that sample as
    `generate()` does with `config` (its defaults for a field left None: temperature 1, top-k 50, top-p 1); greedy is
    top-k 1, no top-k (0) the whole vocabulary (5.19's engine indexes the sorted logits with it unclamped)."""
    if not config.do_sample:
        return {"temperature": 1.0, "top_k": 1, "top_p": 1.0}
    temperature = 1.0 if config.temperature is None else float(config.temperature)
    top_k = 50 if config.top_k is None else int(config.top_k)
    return {"temperature": temperature, "top_k": min(top_k or vocab_size, vocab_size),
            "top_p": 1.0 if config.top_p is None else float(config.top_p)}


def sampling_handler(base: type) -> type:
    """`base` (one of the server's request handlers) building its generation config with `openai_sampling`, and
    handing the request's seed to the generation manager."""

    class SamplingHandler(base):
        def _build_generation_config(self, body: dict, model_generation_config: Any, use_cb: bool = False) -> Any:
            # Without the seed: the server would seed the process's random stream now, in the middle of whatever
            # request the inference thread is generating.
            unseeded = {name: value for name, value in body.items() if name != "seed"}
            config = super()._build_generation_config(unseeded, model_generation_config, use_cb=use_cb)
            _seed.set(None if body.get("seed") is None else int(body["seed"]))
            return openai_sampling(body, config)

    SamplingHandler.__name__ = SamplingHandler.__qualname__ = f"Sampling{base.__name__}"
    return SamplingHandler


def seeded_manager(base: type) -> type:
    """`base` (the server's `GenerateManager`) seeding the random stream with the request's seed on its inference
    thread, just before it generates that request."""

    class SeededGenerateManager(base):
        def submit(self, fn: Any, *args: Any, **kwargs: Any) -> Any:
            return super().submit(_seeding(fn, _seed.get()), *args, **kwargs)

        def async_submit(self, fn: Any, *args: Any, **kwargs: Any) -> Any:
            return super().async_submit(_seeding(fn, _seed.get()), *args, **kwargs)

    return SeededGenerateManager


def _seeding(fn: Any, seed: int | None) -> Any:
    if seed is None:
        return fn

    def seeded(*args: Any, **kwargs: Any) -> Any:
        torch.manual_seed(seed)
        return fn(*args, **kwargs)

    return seeded


def per_request_manager(base: type) -> type:
    """`base` (the server's `CBGenerateManager`) with one sampling engine that takes each request's sampling."""

    class PerRequestCBGenerateManager(base):
        def init_cb(self, model: Any, gen_config: Any) -> None:
            if self._cb is not None:
                return
            engine_config = copy.deepcopy(gen_config)
            engine_config.do_sample = True
            for name, value in ENGINE_SAMPLING.items():
                setattr(engine_config, name, value)
            for name in ("min_p", "typical_p", "epsilon_cutoff", "eta_cutoff", "repetition_penalty", "stop_strings"):
                setattr(engine_config, name, None)
            self._cb_config = _with_per_request_processors(self._cb_config)
            self._vocab_size = model.get_output_embeddings().weight.shape[0]  # the width of the logits sampled from
            super().init_cb(model, engine_config)
            add_request = self._cb.add_request

            def add_request_with_sampling(*args: Any, **kwargs: Any) -> Any:
                return add_request(*args, **{**(_sampling.get() or {}), **kwargs})

            self._cb.add_request = add_request_with_sampling

        def generate_streaming(self, model: Any, processor: Any, inputs: dict, gen_config: Any, request_id: str,
                               *args: Any, **kwargs: Any) -> Any:
            _sampling.set(per_request_sampling(gen_config, self._vocab_size))
            return super().generate_streaming(model, processor, inputs, gen_config, request_id, *args, **kwargs)

        async def generate_non_streaming(self, model: Any, processor: Any, inputs: dict, gen_config: Any,
                                         request_id: str) -> Any:
            _sampling.set(per_request_sampling(gen_config, self._vocab_size))
            return await super().generate_non_streaming(model, processor, inputs, gen_config, request_id)

    return PerRequestCBGenerateManager


def _with_per_request_processors(cb_config: Any) -> Any:
    from transformers import ContinuousBatchingConfig

    if cb_config is None:
        return ContinuousBatchingConfig(per_request_processors=True)
    return dataclasses.replace(cb_config, per_request_processors=True)


__all__ = [
    "NOT_PER_REQUEST",
    "batching_problem",
    "openai_sampling",
    "per_request_manager",
    "per_request_sampling",
    "samples",
    "sampling_handler",
    "seeded_manager",
]
