"""The converter on large checkpoints: time, peak memory and bytes written (`python -m
benchmarks.conversion.bench_conversion`)."""
