"""What a ResFormer costs next to a same-size Llama: training step time and memory, prefill and decode (`bench_cost`,
`bench_decode`), instructions counted under valgrind (`instructions`, `instruction_report`), and SVFormer's cache and
generate() memory (`bench_svformer_cache`, `live_bytes`). Run them as `python -m benchmarks.cost.bench_cost` etc."""
