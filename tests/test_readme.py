"""README.md and the docs/ pages never lie: every snippet runs as written, and CI runs exactly the README's commands.

Each ```python block runs on its own in a fresh interpreter, in one scratch folder shared by all blocks: README.md's
first, then each page of `PAGES` in that order (so a block may use a folder an earlier one saved, as a reader following
along would: README's "Use it" saves `my-resformer`, docs/conversion.md `tiny-llama` and `tiny-resformer`, ...). The
Hub is unreachable in tests, so a preamble (not part of the snippet) intercepts `HfApi`'s repo creation and commits
and records what would have been uploaded. ```bash blocks run their lines with the scratch folder as the current
directory. A block preceded by `<!-- readme-test: skip REASON -->` is not run; REASON must name what covers it instead
(a test file or CI).
"""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
README = REPO / "README.md"
DOCS = REPO / "docs"
#: The docs pages in the order their snippets run, after README.md's (each may use what earlier pages saved).
PAGES = ["fine-tuning", "scaling-out", "conversion", "hub", "serving", "baselines", "value-embeddings",
         "svformer-memory", "analysis", "supported-releases", "works-with", "results", "development"]
DOCUMENTS = [README, *(DOCS / f"{page}.md" for page in PAGES)]
CI_SCRIPT = REPO / ".ci" / "run"
#: The README sections whose commands CI runs as written, and the script that runs them (.ci/run calls the others).
CI_SECTIONS = {"Quickstart": ".ci/run", "Install from a built wheel": ".ci/wheel", "Run the tests": ".ci/run"}

_BLOCK = re.compile(r"(?:<!-- readme-test: skip (?P<skip>[^>]*?) -->\s*\n)?```(?P<lang>\w+)\n(?P<code>.*?)\n```", re.S)

#: Prepended to every Python snippet: records Hub uploads instead of attempting them (tests are offline).
HUB_INTERCEPT = '''
def _intercept_hub_uploads():
    import json
    from huggingface_hub import HfApi, RepoUrl

    def create_repo(self, repo_id, *args, **kwargs):
        return RepoUrl(f"https://huggingface.co/{repo_id}")

    def create_commit(self, repo_id, operations, *args, **kwargs):
        with open("hub_uploads.jsonl", "a") as log:
            log.write(json.dumps({"repo_id": repo_id, "files": sorted(o.path_in_repo for o in operations)}) + "\\n")

    HfApi.create_repo, HfApi.create_commit = create_repo, create_commit


_intercept_hub_uploads()
del _intercept_hub_uploads
'''


@dataclass
class Snippet:
    document: Path
    number: int
    language: str
    code: str
    skip: str | None
    line: int

    def __str__(self) -> str:
        return f"{self.document.relative_to(REPO).as_posix()}:{self.line} ({self.language})"


def readme_snippets() -> list[Snippet]:
    """Every fenced block of README.md and the docs pages, in the order they run."""
    snippets = []
    for document in DOCUMENTS:
        text = document.read_text(encoding="utf-8")
        snippets += [
            Snippet(document, len(snippets) + number, match["lang"], match["code"], match["skip"],
                    text.count("\n", 0, match.start()) + 1)
            for number, match in enumerate(_BLOCK.finditer(text))
        ]
    return snippets


def test_every_docs_page_runs_its_snippets():
    """A page missing from `PAGES` would never run its snippets; a listed page that is gone fails here too."""
    assert sorted(PAGES) == sorted(path.stem for path in DOCS.glob("*.md"))


def _section(title: str) -> str:
    text = README.read_text(encoding="utf-8")
    match = re.search(rf"^## {re.escape(title)}\n(.*?)(?=^## )", text, re.S | re.M)
    assert match, f"README has no '## {title}' section"
    return match.group(1)


def _commands(block: str) -> list[str]:
    """The commands of a bash block: one per line, comments and blank lines dropped."""
    commands = []
    for line in block.splitlines():
        command = line.split(" #", 1)[0].strip()
        if command and not command.startswith("#"):
            commands.append(command)
    return commands


def _section_commands(title: str) -> list[str]:
    blocks = re.findall(r"```bash\n(.*?)\n```", _section(title), re.S)
    return [command for block in blocks for command in _commands(block)]


#: How .ci/run starts a job script beside the others (`in_background bash .ci/NAME`); `finish_background` waits for it.
BACKGROUND = "in_background "


def _ci_commands(script: str) -> tuple[list[str], set[str]]:
    """A CI script's commands, each as the README writes it, and those it runs in the background: a job script started
    with `in_background` counts, and so does each of its own commands, which follow it in the list."""
    commands, background = [], set()
    for command in _commands((REPO / script).read_text(encoding="utf-8")):
        if command.startswith(BACKGROUND):
            job = command.removeprefix(BACKGROUND)
            jobs = [job, *_commands((REPO / job.removeprefix("bash ")).read_text(encoding="utf-8"))]
            commands += jobs
            background.update(jobs)
        else:
            commands.append(command)
    return commands, background


def test_ci_runs_exactly_the_readme_commands():
    """Every command of the README's CI sections runs, in the README's order; a job started in the background
    (whose log and exit status `finish_background` collects) runs beside the others, so its commands' places are
    not checked."""
    for title, script in CI_SECTIONS.items():
        ci, background = _ci_commands(script)
        expected = _section_commands(title)
        assert expected, title
        positions = [ci.index(command) if command in ci else -1 for command in expected]
        assert -1 not in positions, f"{title}: {expected} not all in {script} {ci}"
        in_order = [position for command, position in zip(expected, positions) if command not in background]
        assert in_order == sorted(in_order), f"{title}: {script} runs them in another order"


def _background_functions() -> str:
    """.ci/run's in_background, finish_background and cleanup, as .ci/run defines them."""
    text = CI_SCRIPT.read_text(encoding="utf-8")
    return text[text.index("background=()"):text.index("trap cleanup EXIT")]


def _run_ci_functions(folder: Path, body: str) -> subprocess.CompletedProcess:
    """`body` run after .ci/run's functions, in `folder` with three job scripts: ok, bad (exit 3), slow (a child)."""
    jobs = folder / ".ci"
    jobs.mkdir(parents=True)
    (jobs / "ok").write_text("echo ok says hello\n")
    (jobs / "bad").write_text("echo bad says goodbye\nexit 3\n")
    (jobs / "slow").write_text(f"sleep 300 &\necho $! > {folder}/child.pid\nwait\n")
    script = f"set -euo pipefail\nscratch={folder}/scratch\nmkdir $scratch\n{_background_functions()}\n{body}\n"
    return subprocess.run(["bash", "-c", script], cwd=folder, capture_output=True, text=True, timeout=60)


def test_ci_runs_its_background_jobs_where_they_cannot_race():
    ci, _ = _ci_commands(".ci/run")
    started = [command.removeprefix(BACKGROUND) for command in _commands(CI_SCRIPT.read_text(encoding="utf-8"))
               if command.startswith(BACKGROUND)]
    assert started == ["bash .ci/wheel", "bash .ci/environments"]
    waits = [index for index, command in enumerate(ci) if command == "finish_background"]
    suite = ci.index("python -m pytest -q -n auto --dist loadscope tests")
    # the wheel job is collected before the suite: a broken wheel fails CI in minutes, and the suite has both cores
    assert ci.index("bash .ci/wheel") < waits[0] < suite
    # the virtualenvs are made after the main editable install (one pip at a time writes the clone's egg-info) and
    # while the suite runs, and collected before the first test that needs one
    install = ci.index('pip install "torch==2.13.0" -e ".[test,distributed,clients,serve]"')
    first_use = min(index for index, command in enumerate(ci) if command.startswith(".venv/") and "pytest" in command)
    assert install < ci.index("bash .ci/environments") < suite < waits[1] < first_use, ci
    assert len(waits) == 2


def test_a_job_that_fails_in_the_background_fails_ci_and_its_log_is_printed(tmp_path):
    run = _run_ci_functions(tmp_path / "one", "in_background bash .ci/ok\nin_background bash .ci/bad\n"
                                              "finish_background\necho not reached")
    assert run.returncode == 1, run
    assert "== .ci/ok (in the background; exit status 0) ==\nok says hello" in run.stdout
    assert "== .ci/bad (in the background; exit status 3) ==\nbad says goodbye" in run.stdout
    assert "failed in the background: bad" in run.stdout and "not reached" not in run.stdout
    # as .ci/run: collected, then the rest of the run, then cleanup at exit with nothing left in the background
    run = _run_ci_functions(tmp_path / "two", "trap cleanup EXIT\nin_background bash .ci/ok\nfinish_background\n"
                                              "echo reached")
    assert run.returncode == 0 and run.stdout.endswith("reached\n"), run
    assert not (tmp_path / "two" / "scratch").exists()


def test_a_step_that_fails_stops_the_background_jobs_and_their_children(tmp_path):
    run = _run_ci_functions(tmp_path, "trap cleanup EXIT\nin_background bash .ci/slow\n"
                                      "for _ in $(seq 100); do [ -s " + str(tmp_path) + "/child.pid ] && break; "
                                      "sleep 0.1; done\nfalse\necho not reached")
    assert run.returncode == 1 and "not reached" not in run.stdout, run
    child = int((tmp_path / "child.pid").read_text())
    assert not Path(f"/proc/{child}").exists() or "Z" in Path(f"/proc/{child}/stat").read_text().split()[2]
    assert not (tmp_path / "scratch").exists()


def test_ci_runs_every_ci_script():
    """A job script in .ci/ that .ci/run does not call (directly, or as a README command, or from a job it starts in
    the background) never runs in CI."""
    ci, _ = _ci_commands(".ci/run")
    scripts = sorted(path.name for path in CI_SCRIPT.parent.iterdir() if not path.suffix and path != CI_SCRIPT)
    called = {command.split()[1] for command in ci if command.startswith("bash .ci/")}
    assert scripts and not [name for name in scripts if f".ci/{name}" not in called], (scripts, ci)


def test_every_skipped_snippet_says_what_covers_it():
    for snippet in readme_snippets():
        if snippet.skip is not None:
            reason = snippet.skip
            assert re.search(r"tests/\S+\.py|\.ci/[\w-]+", reason), (
                f"{snippet}: skip reason names no test or CI: {reason}"
            )
            covered = re.findall(r"(tests/\S+\.py|\.ci/[\w-]+)", reason)
            assert all((REPO / path).exists() for path in covered), f"{snippet}: {covered}"


def test_no_page_states_a_count_of_the_tests():
    """A count of the tests goes stale with the next test (issue 68: the README said about 1,850 while pytest
    collected 1,975), so no page states one; a dated measurement ("1,845 passed") may stay."""
    for page in DOCUMENTS:
        found = re.findall(r"(?i)(?:about|around|over|~)\s*[\d,]+\s+(?:sub)?tests\b", page.read_text(encoding="utf-8"))
        assert not found, (page.name, found)


@pytest.fixture(scope="module")
def scratch(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("readme")


def _environment() -> dict[str, str]:
    return {
        **os.environ,
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "HF_HUB_DISABLE_PROGRESS_BARS": "1",
        "TOKENIZERS_PARALLELISM": "false",
        "PYTHONPATH": str(REPO),
    }


@pytest.mark.slow
@pytest.mark.parametrize("snippet", [s for s in readme_snippets() if s.language in ("python", "bash")], ids=str)
def test_readme_snippet_runs_as_written(snippet: Snippet, scratch: Path):
    if snippet.skip is not None:
        pytest.skip(f"not run here: {snippet.skip}")
    if snippet.language == "python":
        script = scratch / f"snippet_{snippet.number}.py"
        script.write_text(HUB_INTERCEPT + "\n" + snippet.code + "\n", encoding="utf-8")
        commands = [[sys.executable, str(script)]]
    else:
        bin_dir = Path(sys.executable).parent
        commands = []
        for command in _commands(snippet.code):
            words = shlex.split(command)
            if words[0] == "python":
                words[0] = sys.executable
            elif (bin_dir / words[0]).exists():
                words[0] = str(bin_dir / words[0])
            commands.append(words)
    uploads = scratch / "hub_uploads.jsonl"
    uploaded_before = uploads.read_text().splitlines() if uploads.exists() else []
    for command in commands:
        result = subprocess.run(command, cwd=scratch, env=_environment(), capture_output=True, text=True, timeout=600)
        assert result.returncode == 0, (
            f"{snippet}: {shlex.join(command)}\n{result.stdout[-2000:]}\n{result.stderr[-4000:]}"
        )
    uploaded = uploads.read_text().splitlines()[len(uploaded_before):] if uploads.exists() else []
    for line in uploaded:  # what a push in the snippet would have put on the Hub: a complete, loadable folder
        files = json.loads(line)["files"]
        assert {"config.json", "model.safetensors", "README.md", "modeling_resformer.py"} <= set(files), files
