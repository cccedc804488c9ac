"""vLLM helpers for `test_serving_vllm.py` and `benchmarks/serving/bench_vllm.py`: engine settings that work on a small
CPU machine, an import blocker that hides this plugin from every process vLLM starts, and a script that runs one vLLM
engine per checkpoint folder in a fresh interpreter.

Run as a script (`python vllm_serving.py JOB.json OUT.json`) it is the engine process: vLLM starts its engine core and
workers with `spawn`, so `LLM(...)` is created under `if __name__ == "__main__"` only. Imported, it holds the pieces
the test and the benchmark share; it imports neither vLLM nor this plugin at module level.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

#: `LLM(...)` / `vllm serve` settings for tiny float32 models on CPU: eager (no compilation), a short context, and an
#: explicit KV cache size (vLLM's CPU backend then skips its memory profiling and warm-up, and the number of cache
#: tokens it allocates measures the cache bytes per token exactly). Head sizes must be ones vLLM's CPU attention
#: supports (32, 64, 80, ...): 16 fails with "Unsupported CPU attention configuration".
KV_CACHE_BYTES = 64 * 2**20
ENGINE_ARGS = dict(
    model_impl="transformers",
    trust_remote_code=True,
    dtype="float32",
    enforce_eager=True,
    max_model_len=256,
    kv_cache_memory_bytes=KV_CACHE_BYTES,
    seed=0,
)

#: `sitecustomize.py` for a directory put first on PYTHONPATH: with RESFORMER_HIDE_PLUGIN=1, every interpreter
#: started with that environment (the engine core and the workers vLLM spawns, the API server) cannot import
#: `resformer_hf` (every import finder returns no spec for it, so `import` fails and `find_spec` is None), so only the
#: remote code copied next to a checkpoint can run.
SITECUSTOMIZE = textwrap.dedent(
    """
    import os, sys

    if os.environ.get("RESFORMER_HIDE_PLUGIN") == "1":

        class HidePlugin:
            def __init__(self, finder):
                self.finder = finder

            def find_spec(self, name, path=None, target=None):
                if name.partition(".")[0] == "resformer_hf":
                    return None
                return self.finder.find_spec(name, path, target)

            def __getattr__(self, attribute):
                return getattr(self.finder, attribute)

        sys.meta_path[:] = [HidePlugin(finder) for finder in sys.meta_path]
    """
)


def engine_env(workdir: Path, hide_plugin: bool) -> dict[str, str]:
    """The environment of an engine or server process: offline, its own remote-code module cache under `workdir`,
    this file's directory on the path (the worker imports `probe_model` from here), and the plugin hidden or not."""
    site = Path(workdir) / "site"
    site.mkdir(parents=True, exist_ok=True)
    (site / "sitecustomize.py").write_text(SITECUSTOMIZE)
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONSTARTUP")}
    paths = [str(site), str(Path(__file__).resolve().parent)]
    if not hide_plugin:  # a source checkout: the plugin importable from the repository root as well
        paths.append(str(Path(__file__).resolve().parents[1]))
    env.update(
        PYTHONPATH=os.pathsep.join(paths),
        RESFORMER_HIDE_PLUGIN="1" if hide_plugin else "0",
        HF_HUB_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
        HF_MODULES_CACHE=str(Path(workdir) / "modules"),
        VLLM_ALLOW_INSECURE_SERIALIZATION="1",  # LLM.apply_model(probe_model) pickles the probe to the worker
        VLLM_NO_USAGE_STATS="1",
        DO_NOT_TRACK="1",
        TOKENIZERS_PARALLELISM="false",
    )
    return env


def run_engine(job: dict, workdir: Path, *, hide_plugin: bool, timeout: int = 900) -> dict:
    """Run `job` (see `main`) in a fresh interpreter; returns its results. Raises with the log's tail on failure."""
    workdir = Path(workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    job_path, out_path, log_path = workdir / "job.json", workdir / "out.json", workdir / "engine.log"
    job_path.write_text(json.dumps(job))
    with open(log_path, "w") as log:
        result = subprocess.run(
            [sys.executable, str(Path(__file__).resolve()), str(job_path), str(out_path)],
            cwd=workdir, env=engine_env(workdir, hide_plugin), stdin=subprocess.DEVNULL, stdout=log,
            stderr=subprocess.STDOUT, timeout=timeout,
        )
    if result.returncode != 0 or not out_path.exists():
        raise RuntimeError(f"vLLM engine process failed (exit {result.returncode}):\n{log_path.read_text()[-6000:]}")
    return json.loads(out_path.read_text())


def free_port() -> int:
    """A free TCP port on 127.0.0.1."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def probe_model(model) -> dict:
    """Runs in the vLLM worker (`LLM.apply_model`): which classes serve, whether the plugin is importable there, and
    the vLLM attention layers (one per decoder layer) that size the KV cache."""
    import importlib.util

    base = model.model
    layers = [layer.self_attn for layer in base.layers]
    return dict(
        served_class=f"{type(model).__module__}.{type(model).__name__}",
        model_class=f"{type(base).__module__}.{type(base).__name__}",
        plugin_importable=importlib.util.find_spec("resformer_hf") is not None,
        plugin_imported="resformer_hf" in sys.modules,
        attention_layers=[
            dict(num_kv_heads=attn.attn.num_kv_heads, head_size=attn.attn.head_size, has_v_proj=hasattr(attn, "v_proj")
                 and attn.v_proj is not None, attention_class=type(attn.attn).__name__,
                 value_store=getattr(attn.attn, "value_store_name", None),
                 layer_name=attn.attn.layer_name,
                 kv_sharing_target=getattr(attn.attn, "kv_sharing_target_layer_name", None))
            for attn in layers
        ],
    )


def fusions(model) -> list[dict]:
    """Runs in the vLLM worker: what vLLM's fusers made of each decoder layer, as the names of the merged modules
    it holds (`qkv_proj`: q/k/v in one `QKVParallelLinear`; `gate_up_proj`: the MLP's two in one GEMM; a norm
    swapped for vLLM's `RMSNorm`)."""
    rows = []
    for layer in model.model.layers:
        rows.append(dict(
            attention=sorted(name for name, child in layer.self_attn.named_children() if "proj" in name),
            mlp=sorted(name for name, child in layer.mlp.named_children()),
            norms={name: type(child).__module__.startswith("vllm") for name, child in layer.named_children()
                   if "norm" in name},
        ))
    return rows


def value_embedding_shares(model) -> dict:
    """Runs in every vLLM worker (`LLM.apply_model`): this rank's share of each value-embedding table (its weight's
    rows and columns) and gate (its output heads), and the rank's index as the table has it (`tp_rank`)."""
    shares = {}
    for name, module in model.named_modules():
        if name.endswith(".value_embedding"):
            shares[name] = dict(weight=list(module.weight.shape), tp_rank=getattr(module, "tp_rank", None))
        elif name.endswith(".value_embedding_gate"):  # vLLM's CPU linears may repack the weight: read the size
            shares[name] = dict(heads=getattr(module, "output_size_per_partition", None))
    return shares


def count_ops(model) -> None:
    """Runs in the vLLM worker (`LLM.apply_model`): from now on, count the ops of each forward pass of `model`, one
    dict a pass: aten ops (views excluded) and vLLM's custom ops, as `tests/test_kernel_budgets.py` counts them."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Count(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops = {}

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if not func.is_view:
                name = str(func.overloadpacket).removeprefix("aten.")
                self.ops[name] = self.ops.get(name, 0) + 1
            return func(*args, **(kwargs or {}))

    forward, model.op_counts = model.forward, []

    def counted(*args, **kwargs):
        with Count() as count:
            output = forward(*args, **kwargs)
        model.op_counts.append(count.ops)
        return output

    model.forward = counted


def counted_ops(model) -> list[dict]:
    """Runs in the vLLM worker: the op counts of every forward pass since `count_ops`."""
    return model.op_counts


def prompt_embeddings_refusal(llm, params) -> str | None:
    """The error a request with prompt embeddings (3 zero vectors) gets, after which the engine must still serve the
    same greedy tokens as before it; None if it was served."""
    import torch

    probe = [{"prompt_token_ids": [5, 6, 7]}]
    before = llm.generate(probe, params, use_tqdm=False)[0].outputs[0].token_ids
    hidden = llm.llm_engine.vllm_config.model_config.get_hidden_size()
    try:
        llm.generate([{"prompt_embeds": torch.zeros(3, hidden)}], params, use_tqdm=False)
    except Exception as error:  # noqa: BLE001  (the test asserts on the message)
        assert llm.generate(probe, params, use_tqdm=False)[0].outputs[0].token_ids == before
        return f"{type(error).__name__}: {error}"
    return None


def main(job_path: str, out_path: str) -> None:
    """Job: {"import_plugin": bool, "in_process"?: bool (default true), "runs": [{"name", "folder", "prompts":
    [[token ids]], "max_tokens", "repeats"?, "engine_args"?, "prompt_embeds_request"?}]}. For each run: one engine,
    greedy generation of every prompt in one batch (`repeats` times), the KV cache it allocated and the probe, and
    what a request with prompt embeddings got if asked. Writes {"name": result} as JSON."""
    job = json.loads(Path(job_path).read_text())
    if job.get("in_process", True):
        # The engine core and the worker in this process (~10 s per engine instead of ~50 s here): the same model
        # code, attention function and paged KV cache; the server test runs vLLM's usual multi-process engine.
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    if job.get("import_plugin"):
        import resformer_hf  # noqa: F401  (registers the plugin's Auto classes in this process)
    from vllm import LLM, SamplingParams

    import vllm_serving  # this file as a module, so the worker can unpickle `probe_model` by name

    results = {}
    for run in job["runs"]:
        start = time.perf_counter()
        in_process = dict(distributed_executor_backend="uni") if job.get("in_process", True) else {}
        llm = LLM(model=run["folder"], **{**ENGINE_ARGS, **in_process, **job.get("engine_args", {}),
                                          **run.get("engine_args", {})})
        loaded = time.perf_counter()
        if run.get("count_ops"):
            llm.apply_model(vllm_serving.count_ops)
        params = SamplingParams(temperature=0.0, max_tokens=run["max_tokens"], ignore_eos=True)
        prompts = [{"prompt_token_ids": ids} for ids in run["prompts"]]
        seconds = []
        for _ in range(run.get("repeats", 1)):
            tick = time.perf_counter()
            outputs = llm.generate(prompts, params, use_tqdm=False)
            seconds.append(time.perf_counter() - tick)
        refusal = prompt_embeddings_refusal(llm, params) if run.get("prompt_embeds_request") else None
        cache = llm.llm_engine.vllm_config.cache_config
        results[run["name"]] = dict(
            tokens=[list(output.outputs[0].token_ids) for output in outputs],
            num_blocks=cache.num_gpu_blocks,
            block_size=cache.block_size,
            kv_cache_bytes=job.get("engine_args", {}).get("kv_cache_memory_bytes", KV_CACHE_BYTES),
            probe=llm.apply_model(vllm_serving.probe_model)[0],
            fusions=llm.apply_model(vllm_serving.fusions)[0],
            shares=llm.apply_model(vllm_serving.value_embedding_shares),  # every rank's
            prompt_embeds_refusal=refusal,
            op_counts=llm.apply_model(vllm_serving.counted_ops)[0] if run.get("count_ops") else None,
            load_seconds=loaded - start,
            generate_seconds=seconds,
        )
        print(f"RESULT {run['name']}: {results[run['name']]['tokens'][0]} ...", flush=True)
        del llm
    Path(out_path).write_text(json.dumps(results))


if __name__ == "__main__":
    main(*sys.argv[1:3])
