"""Instructions per call, counted by valgrind's callgrind: the cost of a step that machine load cannot move.

Timings on a shared machine move by several percent between two identical Llamas; the number of instructions a
decode step executes does not. One valgrind process measures a whole list of models: everything is built,
compiled and warmed up with instrumentation off, then instrumentation is switched on once and each call is counted,
`number` calls per count, collection switched on and off around exactly those calls
(`torch._C._valgrind_toggle`, as `torch.utils.benchmark.Timer.collect_callgrind` does, but without its one process per
statement). Valgrind runs even uninstrumented code on its emulated CPU, where MKL's FMA matrix kernels are ~50×
slower than native: a native process first builds each job's model and prompt and prefills a decode job's cache,
into a file that the counting process loads instead of initialising weights and prefilling again, and runs each
compiled job once, so that the counting process finds its kernels in inductor's on-disk cache. Python's hash seed is
fixed (`PYTHONHASHSEED=0`): with randomised hashing dict lookups, and so the count, move by a few tenths of a percent
between runs; with it two runs agree to the instruction in practice.

    from benchmarks.cost.instructions import Job, count_instructions
    count_instructions([Job("llama", 256, 8, 1, "decode"), Job("identity", 256, 8, 1, "decode")])
"""

from __future__ import annotations

import dataclasses
import gc
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

#: What can be counted: an eager decode step (dynamic cache, as `generate()`), a `torch.compile`d decode step (static
#: cache) and an eager prefill without gradient (fresh dynamic cache).
KINDS = ("decode", "compiled decode", "prefill")


@dataclass(frozen=True)
class Job:
    """One count: model `name` ("llama" or a variant) of hidden × layers, `kind` at batch `batch`.

    Decode steps run after `context` cached tokens; a prefill is `context` tokens. `number` calls per count.
    """

    name: str
    hidden: int
    layers: int
    batch: int
    kind: str
    context: int = 64
    number: int = 4
    vocab_size: int = 2048
    head_dim: int = 32

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ValueError(f"kind={self.kind!r} is not one of {KINDS}")


def callgrind_missing() -> str | None:
    """Why instructions cannot be counted here (None when they can)."""
    for tool in ("valgrind", "callgrind_control"):
        if shutil.which(tool) is None:
            return f"`{tool}` is not on PATH (install valgrind, e.g. `apt-get install valgrind`)"
    import torch

    if not torch._C._valgrind_supported_platform():
        return "this torch build has no valgrind bindings"
    return None


def count_instructions(jobs: list[Job], python: str | None = None, timeout: float | None = None) -> dict[Job, float]:
    """Instructions per call of each job, all counted in one valgrind process (`python` from PATH by default).

    Raises RuntimeError with valgrind's output when the process fails.
    """
    reason = callgrind_missing()
    if reason:
        raise RuntimeError(f"cannot count instructions: {reason}")
    with tempfile.TemporaryDirectory(prefix="instructions-") as folder:
        spec = Path(folder) / "jobs.json"
        spec.write_text(json.dumps([dataclasses.asdict(job) for job in jobs]))
        out = Path(folder) / "callgrind.out"
        root = str(Path(__file__).resolve().parents[2])  # the repository: `benchmarks` importable in the children
        env = {**os.environ, "PYTHONHASHSEED": "0", "OMP_NUM_THREADS": "1", "TORCHINDUCTOR_COMPILE_THREADS": "1",
               "PYTHONPATH": os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")]))}
        python = python or shutil.which("python") or sys.executable
        module = [python, "-m", "benchmarks.cost.instructions"]
        _run([*module, "prepare", str(spec)], env, timeout, "preparing the models and caches")
        done = _run(["valgrind", "--tool=callgrind", "--instr-atstart=no", "--collect-atstart=no",
                     f"--callgrind-out-file={out}", *module, "count", str(spec)], env, timeout, "callgrind run")
        dumps = sorted(Path(folder).glob("callgrind.out.*"), key=lambda path: int(path.suffix[1:]))
        if len(dumps) != len(jobs):
            raise RuntimeError(f"expected {len(jobs)} callgrind dumps, found {len(dumps)}:\n{done.stderr[-4000:]}")
        return {job: _total(dump) / job.number for job, dump in zip(jobs, dumps)}


def _run(command: list[str], env: dict, timeout: float | None, what: str) -> subprocess.CompletedProcess:
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=timeout)
    if done.returncode:
        output = done.stdout[-4000:] + done.stderr[-4000:]
        raise RuntimeError(f"{what} failed ({done.returncode}):\n{output}")
    return done


def _total(dump: Path) -> int:
    """The instructions (Ir) one callgrind dump counted (its `totals:` line)."""
    match = re.search(r"^totals:\s+(\d+)", dump.read_text(), re.MULTILINE)
    if match is None:
        raise RuntimeError(f"no totals line in {dump}")
    return int(match.group(1))


# ---- inside valgrind ----------------------------------------------------------------------------------------------


def _instrument(on: bool) -> None:
    """Switch callgrind's instrumentation of this process on or off (it starts off: setup runs near native speed)."""
    subprocess.run(["callgrind_control", "--instr=" + ("on" if on else "off"), str(os.getpid())], check=True,
                   stdout=subprocess.DEVNULL)


def _prepared_file(spec: Path, index: int) -> Path:
    return spec.with_name(f"prepared-{index}.pt")


def _build(job: Job):
    """(model, prompt): the same weights and prompt in every process (fixed seeds)."""
    import torch

    from benchmarks.common import build_model
    from benchmarks.cost.settings import size_fields

    torch.manual_seed(0)
    size = size_fields(job.hidden, job.layers, vocab_size=job.vocab_size, head_dim=job.head_dim,
                       max_positions=job.context + job.number + 1)
    model = build_model(job.name, **size).eval()
    generator = torch.Generator().manual_seed(1)
    prompt = torch.randint(3, job.vocab_size, (job.batch, job.context), generator=generator)
    return model, prompt


def _new_cache(job: Job, model):
    """An empty cache as the counted call uses it: static for a compiled step, else dynamic as `generate()`'s."""
    from transformers import DynamicCache, StaticCache

    from resformer_hf.remote_code.cache_resformer import share_first_layer_values

    if job.kind == "compiled decode":
        return StaticCache(config=model.config, max_cache_len=job.context + job.number + 1)
    cache = DynamicCache(config=model.config)
    if getattr(model.config, "layers_without_value_projection", None):  # SVFormer: values once, as generate()
        share_first_layer_values(cache)
    return cache


def _prepare(spec: Path) -> None:
    """Natively, for every job: its model, prompt and (decode) prefilled cache into a file, which the counting process
    loads instead of initialising weights and prefilling under valgrind; compiled jobs are also compiled and run once,
    which leaves their kernels in inductor's on-disk cache for the counting process."""
    import torch

    from resformer_hf.remote_code._compat import with_cache

    with torch.no_grad():
        for index, job in enumerate(_jobs(spec)):
            model, prompt = _build(job)
            cache = None
            if job.kind != "prefill":
                cache = _new_cache(job, model)
                model(prompt, **with_cache(cache), use_cache=True)
            torch.save({"model": model, "prompt": prompt, "cache": cache}, _prepared_file(spec, index))
            if job.kind == "compiled decode":
                _repeat(*_action(job, model, prompt, cache), job.number)


def _load(path: Path) -> tuple:
    """(model, prompt, cache) as `_prepare` saved them; a static cache's buffers marked as `StaticLayer` marks them
    (pickling drops the mark)."""
    import torch
    from transformers.cache_utils import StaticLayer

    saved = torch.load(path, weights_only=False)  # written by this count's own preparing process
    cache = saved["cache"]
    for layer in getattr(cache, "layers", ()):
        if isinstance(layer, StaticLayer):
            for name in ("keys", "values", "cumulative_length"):
                if isinstance(layer.__dict__.get(name), torch.Tensor):
                    torch._dynamo.mark_static_address(layer.__dict__[name])
    return saved["model"], saved["prompt"], cache


def _action(job: Job, model, prompt, cache):
    """(rewind, call): `call` is what is counted; `rewind` puts the cache back so that every count sees the same."""
    import torch

    from resformer_hf.remote_code._compat import with_cache

    if job.kind == "prefill":
        return (lambda: None), lambda: model(prompt, **with_cache(_new_cache(job, model)), use_cache=True)
    compiled = job.kind == "compiled decode"
    forward = torch.compile(model.forward, fullgraph=True) if compiled else model.forward
    token = prompt[:, -1:]

    def rewind():
        length = cache.get_seq_length()
        for layer in cache.layers:
            if compiled:
                layer.cumulative_length.fill_(job.context)
            else:
                layer.crop(job.context - length)

    return rewind, lambda: forward(token, **with_cache(cache), use_cache=True)


def _jobs(spec: Path) -> list[Job]:
    return [Job(**fields) for fields in json.loads(spec.read_text())]


def _worker(spec: Path) -> None:
    """Load and warm up every job's call uninstrumented, then switch instrumentation on once and count each.

    Instrumentation is switched on only once: switched off and on again, callgrind went on running some code
    uninstrumented and counted a fraction of a step.
    """
    import torch

    jobs = _jobs(spec)
    actions = []
    with torch.no_grad():
        for index, job in enumerate(jobs):
            rewind, call = _action(job, *_load(_prepared_file(spec, index)))
            for _ in range(2):  # warm-up: first calls compile and fill caches
                _repeat(rewind, call, job.number)
            actions.append((rewind, call))
        gc.collect()
        gc.freeze()  # what exists now is never traversed again: each count's collection costs little under valgrind
        _instrument(True)
        for job, (rewind, call) in zip(jobs, actions):
            _repeat(rewind, call, job.number)  # once instrumented, uncounted: every count starts from the same state
            rewind()
            gc.collect()
            gc.disable()
            torch._C._valgrind_toggle()
            for _ in range(job.number):
                call()
            torch._C._valgrind_toggle_and_dump_stats()
            gc.enable()
            print(f"counted {job}", flush=True)


def _repeat(rewind, call, number: int) -> None:
    rewind()
    for _ in range(number):
        call()


def _main(mode: str, spec: Path) -> None:
    import torch

    torch.set_num_threads(1)
    torch._dynamo.config.recompile_limit = torch._dynamo.config.accumulated_recompile_limit = 1024
    {"prepare": _prepare, "count": _worker}[mode](spec)


if __name__ == "__main__":
    _main(sys.argv[1], Path(sys.argv[2]))
