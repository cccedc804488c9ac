"""Benchmarks and studies against HF `LlamaForCausalLM` of the same size; results in `benchmarks/results/`.

`studies/` trains and reports the pre-training studies (`python -m benchmarks.studies run NAME`); `cost/` measures
training and decode cost (time, memory, instructions, SVFormer's cache); `serving/` continuous batching and vLLM;
`conversion/` the converter on large checkpoints; `gpu/` the prepared run for a session lent a GPU. `common.py` is
what they share.
"""
