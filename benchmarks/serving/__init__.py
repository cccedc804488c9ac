"""Serving next to a same-size Llama: continuous batching's paged cache (`bench_continuous_batching`) and vLLM
(`bench_vllm`, in vLLM's own virtualenv). Run them as `python -m benchmarks.serving.bench_vllm` etc."""
