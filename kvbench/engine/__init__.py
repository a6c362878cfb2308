"""The engine: the static slot cache, its attention and its eviction (cache), the block-prefill / greedy-decode loop
over K runs as the cache's batch rows (generate), per-eviction measures (diagnostics) and the transformers internals
greedy decoding relies on (hf). It knows policies only through their score and what they declare they need."""
