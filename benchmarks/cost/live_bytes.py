"""Peak bytes of live tensors, counted exactly: what a memory table can report on a machine where RSS is noise.

RSS sampled in a thread moves by hundreds of MiB between two identical runs (the allocator keeps freed pages, other
processes push pages out). Here every storage an aten op creates is tracked, and after every op the bytes of those
still referenced anywhere are summed: the same ops give the same number, whatever the machine does.
"""

from __future__ import annotations

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves


class PeakLiveTensorBytes(TorchDispatchMode):
    """Peak bytes of the tensor storages created inside the `with` block that are alive, checked after every aten op.

    A storage counts from the op that creates it (views and in-place ops create none) until nothing but this tracker
    references it. Tensors that existed before the block (weights, the prompt) are not counted, nor an op's internal
    scratch buffers (the granularity is one op). The tracker's own reference delays each free until the next op.
    """

    def __init__(self):
        super().__init__()
        self.live: dict[int, torch.UntypedStorage] = {}
        self.peak = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if not func.is_view:
            inputs = {t.untyped_storage()._cdata for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
            for tensor in tree_leaves(out):
                if isinstance(tensor, torch.Tensor):
                    storage = tensor.untyped_storage()
                    if storage._cdata not in inputs:
                        self.live.setdefault(storage._cdata, storage)
        for key in [key for key in self.live if torch._C._storage_Use_Count(key) <= 1]:
            del self.live[key]  # only this tracker holds it: freed
        self.peak = max(self.peak, sum(storage.nbytes() for storage in self.live.values()))
        return out

    def __exit__(self, *exc):
        self.live.clear()
        return super().__exit__(*exc)
