"""The benchmarks other than the studies (`tests/test_studies.py`), each end to end on a tiny setting with its
numbers' invariants asserted, and the documentation blocks they rewrite."""

from __future__ import annotations

import math

import pytest
import torch

from benchmarks import common
from benchmarks.cost import bench_cost, bench_decode

# ---- the documentation's result blocks ---------------------------------------------------------------------------


def test_result_blocks_are_found_on_their_page_with_links_made_relative_to_it(tmp_path):
    (tmp_path / "docs").mkdir()
    (tmp_path / "README.md").write_text("# front\n<!-- other:begin -->\nx\n<!-- other:end -->\n")
    page = tmp_path / "docs" / "results.md"
    page.write_text("# Results\nbefore\n<!-- cost:begin -->\nold\n<!-- cost:end -->\nafter\n")
    text = "See [cost.md](benchmarks/results/cost.md), [paper](https://arxiv.org/abs/2410.17897), [up](#results).\n"
    assert common.rewrite_readme_block("cost", text, root=tmp_path) == page
    assert page.read_text() == (
        "# Results\nbefore\n<!-- cost:begin -->\nSee [cost.md](../benchmarks/results/cost.md), "
        "[paper](https://arxiv.org/abs/2410.17897), [up](#results).\n<!-- cost:end -->\nafter\n"
    )
    common.rewrite_readme_block("other", text, root=tmp_path)  # on the README, paths stay repository-relative
    assert "[cost.md](benchmarks/results/cost.md)" in (tmp_path / "README.md").read_text()
    assert sorted(path.name for path in tmp_path.rglob("*")) == ["README.md", "docs", "results.md"]  # no staging left
    with pytest.raises(SystemExit, match="found: none"):
        common.rewrite_readme_block("decode", text, root=tmp_path)
    (tmp_path / "docs" / "more.md").write_text("<!-- cost:begin -->\n<!-- cost:end -->\n")
    with pytest.raises(SystemExit, match="found: docs/more.md, docs/results.md"):
        common.rewrite_readme_block("cost", text, root=tmp_path)


def test_every_result_block_of_the_documentation_is_on_exactly_one_page():
    for name in ("cost", "decode", "svformer-cache"):
        begin = f"<!-- {name}:begin -->"
        assert sum(page.read_text().count(begin) for page in common.documentation_pages()) == 1, name


def test_decode_benchmark_end_to_end(tmp_path):
    """Every row and mode of a tiny eager run is written, with Llama's own op count as the zero of the ops column."""
    out = tmp_path / "out"
    bench_decode.main(["--sizes", "64x2", "--batch-sizes", "1", "2", "--compile-sizes", "--context", "8", "--prompt",
                       "4", "--steps", "2", "--new-tokens", "2", "--repeats", "1", "--rounds", "1", "--variants",
                       "dense", "svformer", "--vocab-size", "64", "--threads", "1", "--out", str(out), "--no-readme"])
    table = (out / "decode.md").read_text()
    assert table.count("| Llama again (noise floor) |") == 2 and table.count("| `svformer` |") == 2
    assert "| variant | eager decode | generate | ops per decode step |" in table
    assert "| Llama again (noise floor) | " in table and "compiled decode" not in table.split("## ")[1]
    ops = {line.split(" | ")[0]: int(line.rstrip(" |").split(" | ")[-1]) for line in table.splitlines()
           if line.startswith("| ") and line.rstrip(" |").split(" | ")[-1].lstrip("+-").isdigit()}
    assert ops["| Llama again (noise floor)"] == 0 and ops["| `svformer`"] < 0 < ops["| `dense`"]
    ratios = [float(cell.strip("* ").split()[0]) for line in table.splitlines() if line.startswith("| ")
              and not line.startswith("| variant") for cell in line.strip(" |").split(" | ")[1:3]
              if cell.strip("* ")[:1].isdigit()]
    assert ratios and all(0 < ratio < 100 for ratio in ratios), ratios  # every timing ratio written and finite


def test_cost_benchmark_end_to_end(tmp_path):
    """A tiny eager run writes every column, decode included; the op census is exact, so its signs are asserted:
    SVFormer drops a value projection per layer (fewer ops), `dense` adds its running sum (more), Llama again is 0."""
    out = tmp_path / "out"
    bench_cost.main(["--sizes", "64x2", "--seq-lens", "16", "--batch-size", "1", "--vocab-size", "64", "--variants",
                     "dense", "svformer", "--repeats", "1", "--rounds", "1", "--round-seconds", "0", "--max-repeats",
                     "1", "--decode-steps", "2", "--no-compile", "--no-instructions", "--threads", "1", "--out",
                     str(out), "--no-readme"])
    table = (out / "cost.md").read_text()
    assert "--rounds 1" in table.splitlines()[1] and "--decode-steps 2" in table.splitlines()[1]  # honest command
    assert "| eager decode time |" in table and "| decode step: aten ops, bytes written |" in table
    rows = {line.split(" | ")[0]: line.split(" | ") for line in table.splitlines() if line.startswith("| `")
            or line.startswith("| Llama again")}
    decode_ops = {name: int(cells[7].split(",")[0]) for name, cells in rows.items()}
    assert decode_ops["| Llama again (noise floor)"] == 0 and decode_ops["| `svformer`"] < 0 < decode_ops["| `dense`"]
    # A second, identical Llama: every exact column is exactly Llama's (memory, bytes written, parameters).
    again = [cell.strip(" |*") for cell in rows["| Llama again (noise floor)"]]
    assert (again[2], again[5:8], again[8]) == ("1.000", ["+0, 1.0000"] * 3, "1.000"), again
    assert all(0 < float(cell.split()[0]) for cell in (again[1], again[3], again[4]))  # timed ratios: positive
    svformer = [cell.strip(" |*") for cell in rows["| `svformer`"]]
    assert float(svformer[2]) < 1 and float(svformer[8]) < 1  # no v_proj in layer 1: less memory, fewer parameters
    assert (out / "cost.png").stat().st_size > 0


def test_value_embedding_costs_count_the_tables_and_keep_only_their_gates():
    """Exact counts: the parameters a table and its gate add, and the saved activations: only the gates beyond
    Llama's (2 layers: the table in layer 1)."""
    from benchmarks.cost import value_embedding_costs as costs

    row = costs.measure(64, 2, 16, ["value_embeddings"])[0]
    kv_dim = 64  # 2 kv heads of 32
    assert row[2].startswith(f"{costs.VOCAB * kv_dim + 12 * 2:+,} (")
    assert 1.0 < float(row[4]) < 1.01 and float(row[3]) > 1.1  # the gates alone; the table, its gradient and moments
    assert int(row[7].split(",")[0]) == 13  # one table layer: aten ops, views too (6 kernels: test_value_embeddings)


# ---- smoke tests of the remaining benchmark scripts: each on a tiny setting, its numbers' invariants asserted ----


@pytest.mark.slow  # three fresh processes for generate()'s peak memory: ~1 min idle, 3 min on a busy machine
def test_svformer_cache_benchmark_end_to_end(tmp_path):
    """Cache bytes are exact: Llama and learnable_plus hold 2L tensors per token, SVFormer L + 1, so its ratio is
    (L+1)/(2L) to the digit and learnable_plus's 1; every measured ratio of a model to itself is 1."""
    from benchmarks.cost import bench_svformer_cache

    out = tmp_path / "svformer_cache"
    bench_svformer_cache.main(["--hidden", "32", "--layers", "4", "--head-dim", "8", "--vocab-size", "64",
                               "--contexts", "8", "--new-tokens", "3", "--repeats", "1", "--threads", "1",
                               "--output", str(out), "--no-readme"])
    rows = {(cells[0], cells[1]): cells for cells in
            ([cell.strip() for cell in line.strip("|").split("|")]
             for line in out.with_suffix(".md").read_text().splitlines() if line.startswith("| 8 |"))}
    assert set(rows) == {("8", "llama"), ("8", "learnable_plus"), ("8", "svformer")}, rows
    tokens = 8 + 3 - 1  # the last generated token is never cached
    llama_bytes = 2 * 4 * 1 * 4 * tokens * 8 * 4  # K and V × layers × batch × kv heads × tokens × head dim × fp32
    assert float(rows["8", "llama"][2]) == pytest.approx(llama_bytes / 2**20, abs=0.005)
    assert [rows["8", "llama"][i] for i in (3, 5, 7, 9)] == ["1.0000", "1.000", "1.000", "1.000"]
    assert rows["8", "learnable_plus"][3] == "1.0000" and rows["8", "svformer"][3] == f"{5 / 8:.4f}"
    assert out.with_suffix(".png").stat().st_size > 0


@pytest.mark.slow  # the conversion runs in a fresh process (torch + transformers imports), as the benchmark's does
def test_conversion_benchmark_measures_a_tiny_checkpoint(tmp_path, monkeypatch):
    """The converter writes exactly the source's bytes plus the learnable λ (2 float32 per receiving layer); the
    report states it and the goal lines."""
    import argparse

    from benchmarks.conversion import bench_conversion

    size = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4,
                num_key_value_heads=2, tie_word_embeddings=False, max_position_embeddings=64, dtype="bfloat16")
    row = bench_conversion.measure(tmp_path / "work", size, shard_mb=1, repeats=1, seed=0)
    shapes = bench_conversion.tensor_shapes(size)
    source_bytes = sum(math.prod(shape) * 2 for _, shape in shapes)
    assert row["written"] == source_bytes + 2 * (3 - 1) * 4
    assert row["tensors"] == len(shapes) + 2
    assert row["shards"] == 1 and row["largest"] > source_bytes
    assert row["peak"] >= row["after_imports"] > 0 and row["convert_s"] > 0 and row["copy_s"] > 0
    assert not list((tmp_path / "work").iterdir())  # the synthetic checkpoint and its copies are deleted
    monkeypatch.setattr(bench_conversion, "RESULTS_DIR", tmp_path / "results")
    params = sum(math.prod(shape) for _, shape in shapes)
    bench_conversion.write_results([row], size, params, argparse.Namespace(repeats=1), torch.device("cpu"))
    assert "| 1 |" in (tmp_path / "results" / "conversion.md").read_text()


def test_vllm_benchmark_end_to_end(tmp_path):
    """Serving throughput and KV bytes per token through vLLM; runs where vLLM is installed (`.ci/vllm-venv`). Llama's
    ratio to itself is exactly 1, and the same-size models (a second Llama, learnable_plus) get Llama's KV bytes."""
    pytest.importorskip("vllm", reason="bench_vllm needs vLLM (its own virtualenv, see .ci/vllm-venv)")
    from benchmarks.serving import bench_vllm

    out = tmp_path / "vllm.md"
    # head size 32 (vLLM's CPU attention has no kernel for 16), a vocabulary a byte-level BPE can have
    bench_vllm.main(["--hidden-size", "128", "--layers", "2", "--heads", "4", "--kv-heads", "2", "--vocab-size", "512",
                     "--batches", "1", "--new-tokens", "4", "--prompt-tokens", "4", "--rounds", "1",
                     "--kv-cache-mib", "8", "--output", str(out)])
    rows = {cells[1]: cells for cells in (line.strip("| ").split(" | ") for line in out.read_text().splitlines()
                                          if line.startswith("| 1 |"))}
    assert set(rows) == set(bench_vllm.MODELS), rows
    assert rows["llama"][4] == "1.000" and rows["llama"][7] == "1.000"
    assert rows["llama_2"][7] == rows["learnable_plus"][7] == "1.000"
    assert all(float(cells[2]) > 0 for cells in rows.values())


def test_capacity_benchmark_smoke(tmp_path):
    """The decode-heavy capacity benchmark's GPU command rehearsed at toy size on the CPU (`--smoke`): every request
    of every measured run is answered to its length; one budget holds more SVFormer sequences (4 layers: 2L/(L+1) =
    1.6x, in whole sequences 3 for 2 and 6 for 4) and the engine keeps more of them running; the report renders."""
    from benchmarks.records import read_records
    from benchmarks.serving import bench_capacity

    bench_capacity.main(["--smoke", "--out", str(tmp_path)])
    runs = [r for r in read_records(tmp_path / "capacity.jsonl") if r["part"] == "capacity"]
    work = bench_capacity.SMOKE_WORKLOAD
    assert len(runs) == len(bench_capacity.MODELS) * len(work["budgets"]) * work["rounds"], runs
    assert all(r["ok"] and r["new_tokens"] == r["requests"] * work["new_tokens"] for r in runs), runs
    held = {(r["budget_llama_sequences"], r["name"].split("/")[1]): r for r in runs}
    assert {key: r["sequences"] for key, r in held.items()} == {(2, "llama"): 2, (2, "svformer"): 3,
                                                                (4, "llama"): 4, (4, "svformer"): 6}
    for budget in work["budgets"]:
        assert held[(budget, "svformer")]["mean_concurrency"] > held[(budget, "llama")]["mean_concurrency"]
        assert held[(budget, "llama")]["requests"] == bench_capacity.QUEUE * held[(budget, "svformer")]["sequences"]
    assert all(r["step_ms"] and r["attention"] for r in runs)
    bench_capacity.main(["--report", str(tmp_path / "capacity.jsonl"), "--report-to", str(tmp_path / "capacity.md")])
    page = (tmp_path / "capacity.md").read_text()
    assert "| 2 | 1 | 2 / 3 |" in page and "| 4 | 1 | 4 / 6 |" in page and "Verdict: at the tightest budget" in page
