"""`benchmarks/cost/live_bytes.py`: the peak bytes of live tensors, against sizes worked out by hand."""

from __future__ import annotations

import torch

from benchmarks.cost.live_bytes import PeakLiveTensorBytes


def test_peak_counts_live_storages_once_and_forgets_freed_ones():
    weight = torch.ones(1000)  # before the block: not counted, nor in-place updates of it
    with PeakLiveTensorBytes() as live:
        a = torch.zeros(1000)  # 4000 bytes
        view = a[10:]  # a view: no new storage
        weight.add_(1.0)
        del a
        b = view * 2  # 3960 bytes; `a`'s storage lives on through the view: 7960
        del view
        c = torch.zeros(500)  # `a` freed: 3960 + 2000
        del b, c
        d = torch.empty(3000)  # 12000 bytes alone: the peak
        del d
    assert live.peak == 12000
    with PeakLiveTensorBytes() as live:
        e = torch.zeros(1000)
        f = torch.zeros(1000)
        g = e + f  # three live together: 12000
    assert live.peak == 12000 and g.shape == (1000,)


def test_the_same_generate_peaks_at_the_same_bytes():
    from transformers import LlamaConfig, LlamaForCausalLM

    model = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                         num_attention_heads=2, num_key_value_heads=2)).eval()
    prompt = torch.randint(3, 64, (1, 40), generator=torch.Generator().manual_seed(0))
    peaks = []
    for _ in range(2):
        with torch.no_grad(), PeakLiveTensorBytes() as live:
            model.generate(prompt, max_new_tokens=3, do_sample=False, pad_token_id=0, eos_token_id=None)
        peaks.append(live.peak)
    cache = 2 * 2 * 43 * 32 * 4  # layers × (keys, values) × tokens × kv width × float32: held at the end at least
    assert peaks[0] == peaks[1] >= cache
