"""lm-eval through `resformer-serve`, offline: `local-completions` (lm-eval's OpenAI-compatible client, as it sends its
requests: token-id prompts, `seed` 1234, `stop` on every generation request, `echo` + `logprobs` 1 + `max_tokens` 1
on every loglikelihood request) against the server, with and without `--continuous-batching`, scores what
`--model hf` scores on the same folder: every log-likelihood to 1e-4, every greedy generation identical. The tasks are
the repository's own (`tests/lm_eval_tasks/`: a generation task whose `until` cuts most generations, and a
multiple-choice task), over local documents. The reference `hf` runs load the ResFormer with the plugin's classes and
from its remote code alone; a Llama folder served the same way is the control. One run is lm-eval's own command line
(`lm_eval run --model local-completions ...`) against the batching server."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import yaml
from transformers.utils.import_utils import is_serve_available

if not is_serve_available():
    pytest.skip("transformers serve needs FastAPI, uvicorn and openai: pip install -e '.[serve]'",
                allow_module_level=True)
lm_eval = pytest.importorskip("lm_eval", reason="lm-eval is in the `clients` extra")
for _module in ("aiohttp", "tenacity"):  # lm-eval's API models need its `api` extra (the `clients` extra has it)
    pytest.importorskip(_module, reason="lm-eval's API models need lm-eval[api], in the `clients` extra")

from hf_serving import CB_FLAGS, REPO, Reference, Server, write_folders  # noqa: E402

pytestmark = pytest.mark.slow

TASKS = REPO / "tests" / "lm_eval_tasks"
GENERATION, CHOICE = "resformer_toy_generation", "resformer_toy_choice"
#: The test folders' context (hf_serving.write_folders): lm-eval's API client is told it, as `hf` reads it.
CONTEXT = 128
#: lm-eval's loglikelihoods through the server against `hf`'s: float32 forward passes of a few dozen tokens differ
#: by ~1e-6 (batched with padding in `hf`, one sequence in the server); a wrong token or position is off by ~0.1-5.
TOLERANCE = 1e-4


def task_configs(folder: Path) -> list[dict]:
    """The repository's task YAMLs as lm-eval configs, their data files under `folder` (absolute)."""
    configs = []
    for name in ("toy_generation", "toy_choice"):
        config = yaml.safe_load((TASKS / f"{name}.yaml").read_text())
        config["dataset_kwargs"]["data_files"]["test"] = str(folder / f"{name}.jsonl")
        configs.append(config)
    return configs


def evaluate(model: str, model_args: dict, batch_size: int = 1) -> dict[str, list[dict]]:
    """Samples per task of an in-process lm-eval run (`simple_evaluate`, as the command line calls it)."""
    from lm_eval.tasks import TaskManager

    results = lm_eval.simple_evaluate(
        model=model, model_args=model_args, tasks=task_configs(TASKS), batch_size=batch_size, log_samples=True,
        bootstrap_iters=0, task_manager=TaskManager(include_defaults=False),  # indexing the built-in tasks: ~40 s
    )
    return results["samples"]


def hf(folder: Path, remote_code: bool = False) -> dict[str, list[dict]]:
    args = {"pretrained": str(folder), "device": "cpu", "dtype": "float32", "trust_remote_code": remote_code}
    return evaluate("hf", args)


def served_args(server: Server, folder: Path) -> dict:
    return {"model": str(folder), "base_url": f"http://127.0.0.1:{server.port}/v1/completions",
            "tokenizer": str(folder), "tokenizer_backend": "huggingface", "tokenized_requests": True,
            "max_length": CONTEXT, "max_retries": 1, "num_concurrent": 1}


def documented_args(server: Server, folder: Path) -> str:
    """docs/serving.md's `lm_eval run` `--model_args` (issue 68), for `server` on `folder`: the documented folder
    and port replaced by the test's, `max_length` by the test folders' context, and every other setting as the page
    gives it (the page's `model=` and `tokenizer=` must be the folder it serves)."""
    page = (REPO / "docs" / "serving.md").read_text(encoding="utf-8")
    (line,) = [line for line in page.splitlines() if line.startswith("lm_eval run --model local-completions")]
    documented = dict(pair.split("=", 1) for pair in line.split("--model_args ")[1].split()[0].split(","))
    served = documented["model"]
    assert documented["tokenizer"] == served and f"resformer-serve {served} --port 8000" in page, documented
    assert documented["base_url"] == "http://127.0.0.1:8000/v1/completions", documented
    args = {**documented, "model": str(folder), "tokenizer": str(folder), "max_length": str(CONTEXT),
            "base_url": f"http://127.0.0.1:{server.port}/v1/completions", "max_retries": "1"}
    return ",".join(f"{key}={value}" for key, value in args.items())


def generations(samples: dict) -> list[str]:
    return [sample["resps"][0][0] for sample in samples[GENERATION]]


def loglikelihoods(samples: dict) -> list[float]:
    """Every (document, choice) log-likelihood, in order (lm-eval's samples files hold them as strings)."""
    return [float(choice[0][0]) for sample in samples[CHOICE] for choice in sample["resps"]]


def accuracies(samples: dict) -> list[float]:
    return [sample["acc"] for sample in samples[CHOICE]]


def assert_same_results(got: dict, expected: dict) -> None:
    """Every greedy generation identical, every log-likelihood within `TOLERANCE`, the same accuracy per document
    (all three checked, every difference reported)."""
    assert len(got[GENERATION]) == len(expected[GENERATION]) == 24
    assert [sample["doc"] for sample in got[CHOICE]] == [sample["doc"] for sample in expected[CHOICE]]
    worst = max(abs(a - b) for a, b in zip(loglikelihoods(got), loglikelihoods(expected)))
    differences = [(index, ours, theirs) for index, (ours, theirs) in enumerate(zip(generations(got),
                                                                                     generations(expected)))
                   if ours != theirs]
    problems = [f"{len(differences)} generations differ: {differences[:3]}"] if differences else []
    if worst > TOLERANCE:
        problems.append(f"max |loglikelihood difference| {worst:.3g} > {TOLERANCE}")
    if accuracies(got) != accuracies(expected):
        problems.append(f"accuracy {sum(accuracies(got))} vs {sum(accuracies(expected))} of {len(accuracies(got))}")
    assert not problems, problems
    print(f"max |loglikelihood difference| {worst:.2e}, acc {sum(accuracies(got)) / len(accuracies(got)):.4f}, "
          f"{len(generations(got))} generations identical")


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    return write_folders(tmp_path_factory.mktemp("lm-eval-serving"))


@pytest.fixture(scope="module")
def starting(folders, tmp_path_factory):
    """The servers, starting in the background (while `hf` runs): the SVFormer folder served plainly and with
    continuous batching, the Llama control with continuous batching."""
    logs = tmp_path_factory.mktemp("logs")
    plan = {"svformer": ("svformer", ()), "svformer-batched": ("svformer", CB_FLAGS),
            "llama-batched": ("llama", CB_FLAGS)}
    pool = ThreadPoolExecutor(len(plan))
    futures = {name: pool.submit(Server, folders[folder], logs / f"{name}.log", *flags)
               for name, (folder, flags) in plan.items()}
    try:
        yield futures
    finally:
        pool.shutdown(wait=True)
        started = [future.result() for future in futures.values() if future.exception() is None]
        for server in started:  # all stop at once (each takes seconds)
            if server.process.poll() is None:
                server.process.send_signal(signal.SIGTERM)
        for server in started:
            server.close()


@pytest.fixture(scope="module")
def servers(starting):
    return {name: future.result() for name, future in starting.items()}


@pytest.fixture(scope="module")
def references(folders, starting):
    """`hf`'s samples: the SVFormer with the plugin's classes and from its remote code, the Llama."""
    return {"svformer": hf(folders["svformer"]), "svformer-remote": hf(folders["svformer"], remote_code=True),
            "llama": hf(folders["llama"])}


def test_the_reference_is_sound(folders, references):
    """The plugin and the remote code score alike; the `until` strings cut most generations short of their 16
    tokens (so the server's `stop` is exercised), and the choices' log-likelihoods differ (a constant answer would
    not pass)."""
    import torch

    assert_same_results(references["svformer-remote"], references["svformer"])
    reference = Reference(folders["svformer"])
    cut = 0
    for sample, text in zip(references["svformer"][GENERATION], generations(references["svformer"])):
        ids = reference.tokenizer(sample["doc"]["prompt"], add_special_tokens=False)["input_ids"]
        whole = reference.model.generate(torch.tensor([ids]), max_new_tokens=16, do_sample=False)[0, len(ids):]
        uncut = reference.tokenizer.decode(whole, skip_special_tokens=True)
        assert uncut.startswith(text)
        cut += len(text) < len(uncut)
    assert cut >= 18, generations(references["svformer"])
    assert len(set(loglikelihoods(references["svformer"]))) == 72


@pytest.mark.parametrize("name", ["svformer", "svformer-batched", "llama-batched"])
def test_local_completions_against_the_server_scores_what_hf_scores(servers, folders, references, name):
    folder = "llama" if name.startswith("llama") else "svformer"
    got = evaluate("local-completions", served_args(servers[name], folders[folder]))
    assert_same_results(got, references[folder])


def test_lm_evals_command_line_against_the_batching_server(servers, folders, references, tmp_path):
    """`lm_eval run --model local-completions --tasks <the task YAMLs> --log_samples` in a process of its own, with
    docs/serving.md's `--model_args` (offline; lm-eval's index of its built-in tasks is skipped, ~40 s)."""
    tasks = tmp_path / "tasks"
    tasks.mkdir()
    for config in task_configs(TASKS):
        (tasks / f"{config['task']}.yaml").write_text(yaml.safe_dump(config))
    args = documented_args(servers["svformer-batched"], folders["svformer"])
    command = ("import functools, sys\nfrom lm_eval.tasks import TaskManager\n"
               "TaskManager.__init__ = functools.partialmethod(TaskManager.__init__, include_defaults=False)\n"
               "from lm_eval.__main__ import cli_evaluate\nsys.exit(cli_evaluate())")
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
    done = subprocess.run([sys.executable, "-c", command, "run", "--model", "local-completions", "--model_args",
                           args, "--tasks", f"{GENERATION},{CHOICE}", "--include_path", str(tasks), "--log_samples",
                           "--output_path", str(tmp_path / "out")],
                          capture_output=True, text=True, timeout=600, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    samples = {}
    for task in (GENERATION, CHOICE):
        (path,) = (tmp_path / "out").rglob(f"samples_{task}_*.jsonl")
        samples[task] = [json.loads(line) for line in path.read_text().splitlines()]
        samples[task].sort(key=lambda sample: sample["doc_id"])
    expected = {task: sorted(references["svformer"][task], key=lambda sample: sample["doc_id"])
                for task in (GENERATION, CHOICE)}
    assert_same_results(samples, expected)
