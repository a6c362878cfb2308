"""The engine: a policy-managed KV cache (cache), the attention wrapper that feeds policies and masks evicted
caches correctly (attention), the block-prefill / greedy-decode loop (generate) and per-eviction measures
(diagnostics). It knows policies only through what they declare they need."""
