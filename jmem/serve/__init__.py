"""Serving: paged KV cache, continuous batching, OpenAI-compatible HTTP server.

Layers, bottom up (import the module you need; the first three are plain Python that uses no JAX,
though importing `jmem` itself loads it):
    block_pool.BlockPool        blocks, ref counts, LRU free queue, prefix hashes
    kv_cache.KVCacheManager     blocks per request, prefix hits, capacity
    scheduler.Scheduler         token budget, decode first, chunked prefill, preemption by recompute
    jmem.sampling.sample        batched per-request sampling (jitted; shared with `jmem.generate`)
    paged_cache.PagedKVCache    the model's KV-cache protocol over paged K/V
    lora.MultiLoRA              several LoRA adapters stacked in one weight leaf, one slot per token
    runner.ModelRunner          device arrays and the jitted mixed prefill/decode step
    engine.Engine               scheduler + runner + detokenizer, background loop, streams
    api.create_app              FastAPI app; cli.run_serve is `jmem serve`
"""

DEFAULT_MAX_REQUEST_BYTES = 32 * 2**20
"""Largest request body (`jmem serve --max-request-bytes`): far above a long context's prompt, small
enough that one body cannot hold the event loop for seconds while it is parsed."""
