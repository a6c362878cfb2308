"""The attention wrapper: gives policies what they need from inside the forward, and keeps masks right per layer.

Registered under `kvbench_sdpa` / `kvbench_eager` in HF's `AttentionInterface` **and** `AttentionMaskInterface`
(without the mask registration HF builds no mask for an unknown implementation and sdpa silently slices the keys).
The wrapper receives post-norm, post-RoPE queries, the layer's whole key/value (cache + block), the model's own
`scaling` and softcap; it then
- stashes the latest queries for policies that score with them (only when the active policy asks),
- fills the new tokens' per-token policy state (`Policy.on_append`),
- rebuilds the causal mask when this layer's key length differs from the mask HF built for the first layer (layers
  hold different numbers of tokens when some are not evicted),
- computes attention itself (query-chunked, never prompt^2 at once) when the policy needs the probabilities,
  handing them to `Policy.on_attention` and reusing them for the output,
- on ragged layers (per-head budgets, stored flat per KV head: see engine/ragged.py) ignores the `key`/`value` it is
  handed (the layer's flat storage) and attends each KV head's query group over that head's own keys (head by head on
  CPU, in one masked attention over the heads padded to the longest on CUDA: `ragged_attention`), keeping for the
  policy the mean probabilities of the latest queries it asks for (`Policy.attention_rows`: SnapKV's window),
and otherwise delegates to sdpa or the model file's own eager function.

The active cache is found through a context variable set by `active(cache)`, so plain forwards outside kvbench
runs go straight to the base implementation. A `BatchCache` (several samples in one forward, engine/cache.py) makes
the wrapper do all of the above per sample, each sample's query rows over its own layer with its own mask, as its
batch-1 forward would; only the projections and MLPs around it see the batch.
"""

from __future__ import annotations

import contextlib
import contextvars
import math
import sys
from typing import Any, Callable, Iterator

import torch

from kvbench.engine.cache import BatchCache, EvictingCache, EvictingLayer, TrunkCache, settle_state

_ACTIVE: contextvars.ContextVar[EvictingCache | BatchCache | TrunkCache | None] = contextvars.ContextVar(
    "kvbench_cache", default=None)
QUERY_CHUNK = 256  # queries per chunk when computing attention probabilities explicitly


@contextlib.contextmanager
def active(cache: EvictingCache | BatchCache | TrunkCache) -> Iterator[None]:
    """Route attention of forwards inside this block through `cache`'s policy (a BatchCache: each sample's)."""
    token = _ACTIVE.set(cache)
    try:
        yield
    finally:
        _ACTIVE.reset(token)


def _base_function(module: Any, base: str) -> Callable[..., Any]:
    if base == "sdpa":
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        return sdpa_attention_forward
    # The model file's own eager function knows its quirks (softcap, sinks, ...).
    return sys.modules[type(module).__module__].eager_attention_forward


def _fit_mask(mask: torch.Tensor | None, q_len: int, kv_len: int, base: str, dtype: torch.dtype,
              device: torch.device, memo: dict[Any, torch.Tensor] | None = None) -> torch.Tensor | None:
    """The HF mask if it fits this layer; otherwise a rebuilt causal one in the base implementation's format.

    `memo` keeps rebuilt masks by shape: layers with the same length (all evicted layers, when some layers are not
    evicted) share one instead of rebuilding it per layer and block; it holds at most 4 (masks are read-only).
    """
    if mask is not None and mask.shape[-1] == kv_len:
        return mask
    if mask is None and (q_len == 1 or q_len == kv_len):
        return None  # sdpa/eager handle these exactly without a mask
    key = (q_len, kv_len, base, dtype, device)
    if memo is not None and key in memo:
        return memo[key]
    # The block is the last q slots; every earlier slot is visible to all of it.
    i = torch.arange(q_len, device=device).view(-1, 1)
    j = torch.arange(kv_len, device=device).view(1, -1)
    m = (j <= i + (kv_len - q_len)).view(1, 1, q_len, kv_len)  # (1, 1, q, kv) bool
    if base != "sdpa":
        m = torch.zeros(m.shape, dtype=dtype, device=device).masked_fill(~m, torch.finfo(dtype).min)
    if memo is not None:
        if len(memo) >= 4:
            memo.clear()
        memo[key] = m
    return m


def explicit_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scaling: float,
                       softcap: float | None, on_probs: Callable[[torch.Tensor], None] | None = None,
                       lengths: torch.Tensor | None = None, shortest: int | None = None,
                       on_rows: tuple[int, Callable[[torch.Tensor], None]] | None = None) -> torch.Tensor:
    """Causal attention of the block (the last q slots) over all slots, computed in query chunks.

    `lengths` (b, h_kv), with `shortest` its minimum known on the host: the KV heads hold that many real slots each,
    padded at the end to the longest (a ragged layer's padded layout); the block is then the last q real slots of
    each head, and padded slots get logit -inf, so weight exactly 0 (they lie after every query of the block, so the
    causal mask already hides them).

    Precision: logits and softmax in float32, the product with the values in the input dtype, as sdpa's fused
    kernels do (QK^T accumulated and kept in float32, on CPU and CUDA). HF's eager path rounds the logits to a
    bfloat16/float16 input dtype before the softmax; for the policy that scores with these probabilities (H2O) that
    rounding ties or swaps tokens whose logits differ by less than a bfloat16 step (tests/test_bf16.py). For float32
    inputs the casts are no-ops. `on_probs` receives each chunk's probabilities averaged over the query heads of
    each KV head, (b, h_kv, c, kv) float32. `on_rows` (k, fn): fn receives the mean over the block's latest k queries
    of their probabilities, (b, h_kv, g, kv) float32, when the last chunk holds them all (k <= its queries).
    Returns (b, q, h_q, d) like the eager functions.
    """
    b, h_q, q_len, d = query.shape  # (b, h_q, q, d)
    h_kv, kv_len = key.shape[1], key.shape[2]
    g = h_q // h_kv
    off = kv_len - q_len  # slots before the block: visible to every query
    kt = key.float().transpose(-1, -2).reshape(b * h_kv, d, kv_len)  # (b*h_kv, d, kv) float32
    zero = query.new_zeros((), dtype=torch.float32)
    d_v = value.shape[-1]
    if q_len == 1 and lengths is None:  # a decoding step: one query, every slot before it (nothing to mask)
        return _one_query(query, kt, value, zero, scaling, softcap, on_probs, on_rows)
    out = value.new_empty(b, h_kv, g, q_len, d_v)
    # Per chunk of c queries, the (b, h_kv, g, c, kv) logits are the big tensor: every step below works on it in
    # place (scale fused into the matmul, causal mask only on the part a query can miss), which measured ~20 %
    # cheaper than fresh tensors per step on CPU.
    for s in range(0, q_len, QUERY_CHUNK):
        e = min(q_len, s + QUERY_CHUNK)
        c = e - s
        qc = query[:, :, s:e].float().reshape(b * h_kv, g * c, d)  # (b*h_kv, g*c, d) float32
        logits = torch.baddbmm(zero, qc, kt, beta=0.0, alpha=scaling).view(b, h_kv, g, c, kv_len)
        if softcap:
            logits.div_(softcap).tanh_().mul_(softcap)
        if lengths is None:
            first = off + s + 1  # first slot some query of this chunk must not see
            if first < kv_len:
                j = torch.arange(first, kv_len, device=query.device)
                i = torch.arange(s, e, device=query.device).view(-1, 1)
                logits[..., first:].masked_fill_((j > i + off).view(1, 1, 1, c, kv_len - first), -math.inf)
        else:
            # head h's query i (of the block) sees its slots j <= lengths[h] - q_len + i; only slots from the shortest
            # head's first hidden one on can be hidden
            first = shortest - q_len + s + 1
            if first < kv_len:
                j = torch.arange(first, kv_len, device=query.device)  # (kv - first,)
                last = (lengths - q_len).view(b, h_kv, 1, 1) + torch.arange(s, e, device=query.device).view(-1, 1)
                hidden = j > last  # (b, h_kv, c, kv - first)
                logits[..., first:].masked_fill_(hidden.unsqueeze(2), -math.inf)
        probs = torch.softmax(logits, dim=-1)  # (b, h_kv, g, c, kv)
        if on_probs is not None:
            on_probs(probs.mean(dim=2))
        if on_rows is not None and e == q_len and c >= on_rows[0]:
            on_rows[1](probs[:, :, :, c - on_rows[0]:].mean(dim=-2))
        out[:, :, :, s:e] = torch.matmul(probs.to(value.dtype).view(b, h_kv, g * c, kv_len),
                                         value).view(b, h_kv, g, c, d_v)
    return out.view(b, h_q, q_len, d_v).transpose(1, 2).contiguous()  # (b, q, h_q, d_v)


def _one_query(query: torch.Tensor, kt: torch.Tensor, value: torch.Tensor, zero: torch.Tensor, scaling: float,
               softcap: float | None, on_probs: Callable[[torch.Tensor], None] | None,
               on_rows: tuple[int, Callable[[torch.Tensor], None]] | None) -> torch.Tensor:
    """`explicit_attention` of one query (b, h_q, 1, d) over every slot, `kt` (b*h_kv, d, kv) its float32 keys: the
    same kernels on the same shapes as its one chunk (so the same bits), without the chunk loop, the output buffer
    and its copies, which are most of a call's time at one query (a ragged layer's decoding step makes one call per
    KV head: 90 a step on SmolLM2, 13.4 -> 12.2 ms in a warm micro-benchmark on one CPU thread)."""
    b, h_q, _, d = query.shape
    h_kv, kv_len = value.shape[1], value.shape[2]
    g = h_q // h_kv
    logits = torch.baddbmm(zero, query.float().reshape(b * h_kv, g, d), kt, beta=0.0,
                           alpha=scaling).view(b, h_kv, g, 1, kv_len)
    if softcap:
        logits.div_(softcap).tanh_().mul_(softcap)
    probs = torch.softmax(logits, dim=-1)  # (b, h_kv, g, 1, kv)
    if on_probs is not None:
        on_probs(probs.mean(dim=2))
    if on_rows is not None and on_rows[0] <= 1:
        on_rows[1](probs.mean(dim=-2))
    out = torch.matmul(probs.to(value.dtype).view(b, h_kv, g, kv_len), value)  # (b, h_kv, g, d_v)
    return out.view(b, 1, h_q, value.shape[-1])  # (b, q, h_q, d_v): with one query, the same memory


def ragged_attention(query: torch.Tensor, layer: EvictingLayer, scaling: float, softcap: float | None,
                     batched: bool | None = None, rows: int = 0) -> torch.Tensor:
    """Attention of the block over a ragged layer's flat storage: each KV head's query group attends to that head's
    own keys (the block is the last q of them), as `explicit_attention`. Returns (b, q, h_q, d_v).

    Two computations of the same values (up to float rounding: the kernels sum over the padded length or the head's
    own; tests/test_window_state.py):
    - `batched`: one masked attention over all heads, their keys and values padded to the longest head
      (`EvictingLayer.padded_kv`, a transient copy of the layer's K/V), padded slots at weight exactly 0: one chain of
      kernels whatever the number of heads, which is what a GPU wants (not measured: no GPU was available);
    - per head: one explicit_attention per (batch, KV head) segment, on views of the flat storage (no copy). Faster
      on CPU, where the padding copy costs more than the per-head calls: measured one decoding token over ~1024 keys
      per head, 0.30 vs 0.50 ms per layer with SmolLM2's 3 KV heads (head_dim 64), 1.9 vs 6.9 ms with Llama-3.2-3B's
      8 (head_dim 128); a 128-token block 6.5 vs 8.5 ms (3 heads).
    `batched=None`: batched on CUDA, per head elsewhere.
    `rows` > 0 (`Policy.attention_rows`): the mean over the block's latest `rows` queries of their probabilities per
    query head is kept as `layer.forward_rows`, (b, h_q, L) in the padded view's layout (0 on padding), for the
    eviction after this forward (SnapKV's window on AdaKV: the per-head products and softmax it would compute again).
    """
    if batched is None:
        batched = query.device.type == "cuda"
    b, h_q, q_len, _ = query.shape  # (b, h_q, q, d)
    sizes = layer.head_sizes  # on the host: splitting or padding by `lengths` would read the device
    mean = query.new_zeros(b, h_q, max(sizes), dtype=torch.float32) if rows else None  # (b, h_q, L)
    got: list[bool] = []

    def keep_rows(bi: int | slice, heads: slice, n: int) -> tuple[int, Callable[[torch.Tensor], None]] | None:
        """explicit_attention's `on_rows` writing a head's (1, 1, g, n_i) means, or all (b, h_kv, g, L), into `mean`."""
        def fn(p: torch.Tensor) -> None:
            part = mean[bi, heads, :n]  # (g, n_i) or (b, h_q, L)
            part.copy_(p.reshape(part.shape))
            got.append(True)
        return (rows, fn) if rows else None

    if batched:
        keys, values = layer.padded_kv()  # (b, h_kv, L, d)
        out = explicit_attention(query, keys, values, scaling, softcap, lengths=layer.lengths, shortest=min(sizes),
                                 on_rows=keep_rows(slice(None), slice(None), max(sizes)))
    else:
        h_kv = layer.lengths.shape[1]
        g = h_q // h_kv
        out = layer.values.new_empty(b, q_len, h_q, layer.values.shape[-1])
        flat = layer.flat
        for i, (k, v) in enumerate(zip(flat.views(layer.keys), flat.views(layer.values))):  # (n_i, d) each
            bi, hi = divmod(i, h_kv)
            heads = slice(hi * g, (hi + 1) * g)
            qi = query[bi:bi + 1, heads]  # (1, g, q, d)
            out[bi, :, heads] = explicit_attention(qi, k[None, None], v[None, None], scaling, softcap,
                                                   on_rows=keep_rows(bi, heads, sizes[i]))[0]
    if mean is not None and got:
        layer.forward_rows = (layer.seen, rows, mean)
    return out


def _hooks(module: Any, cache: EvictingCache, layer: EvictingLayer, query: torch.Tensor, scaling: float,
           softcap: float | None) -> bool:
    """The policy's work on `layer` of `cache` before attention: stashed queries and the new tokens' per-token state.
    Returns whether the policy is active on this layer (then a `needs_attention` policy gets explicit attention)."""
    layer.scaling, layer.softcap, layer.module = scaling, softcap, module
    policy = cache.policy
    # Layers the policy never evicts (K-norm's first two) cost no policy work: no queries, state or attention.
    if policy is None or cache.frozen or layer.layer_idx not in cache.evicted:
        return False
    if cache.query_window:
        layer.stash.add(query, layer.seen, cache.query_window)
    if policy.state_names:
        if layer.state_due is not None:  # a previous token's, left due by a step that did not evict this layer
            settle_state(layer, policy)
        if policy.state_from_tokens and layer.block_slots is not None and not layer.ragged:
            # a decoding token written into a hole: its state at the eviction, with the other layers' (settle_state)
            layer.state_due = (layer.block_slots, layer.block_states[0], query)
            return True
        if policy.state_starts_zero and all(name in layer.state for name in policy.state_names):
            return True  # the new tokens' rows are 0 already (EvictingLayer.update)
        new = policy.on_append(layer, module, *layer.block_kv(query.shape[-2]), query)
        for name in policy.state_names:
            layer.set_block_state(name, new[name])
    return True


def _attend(module: Any, cache: EvictingCache, layer: EvictingLayer, query: torch.Tensor, key: torch.Tensor,
            value: torch.Tensor, attention_mask: torch.Tensor | None, scaling: float | None, base: str,
            base_fn: Callable[..., Any], **kwargs: Any) -> torch.Tensor:
    """One sample's attention over its own layer `layer` of `cache` (query (1, h_q, q, d) for a batched forward's
    row), with the policy's hooks; returns (b, q, h_q, d_v). `scaling` None: the model's default, head_dim^-0.5."""
    if scaling is None:
        scaling = module.head_dim ** -0.5
    q_len, kv_len = query.shape[-2], key.shape[-2]
    policy = cache.policy
    active = _hooks(module, cache, layer, query, scaling, kwargs.get("softcap"))
    if active and policy.needs_attention:
        if layer.ragged:
            raise NotImplementedError(f"policy '{policy.name}' needs attention probabilities, which "
                                      "kvbench does not compute on ragged per-head layers")
        return explicit_attention(query, key, value, scaling, layer.softcap,
                                  lambda p: policy.on_attention(layer, p))
    if layer.ragged:  # per-head budgets: `key`/`value` are the flat storage; each head over its own keys
        return ragged_attention(query, layer, scaling, layer.softcap,
                                rows=policy.attention_rows(layer, q_len) if active else 0)
    mask = _fit_mask(attention_mask, q_len, kv_len, base, query.dtype, query.device, cache.masks)
    return base_fn(module, query, key, value, mask, scaling=scaling, **kwargs)[0]


def _attend_trunk(module: Any, trunk: TrunkCache, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                  attention_mask: torch.Tensor | None, scaling: float | None, base: str,
                  base_fn: Callable[..., Any], **kwargs: Any) -> torch.Tensor:
    """A shared forward's attention: every member's hooks on its own layer (each timed on the trunk's clock, its own
    work), then the output once, as each member's solo forward computes it (their K/V are the same tensors, and the
    trunk's members take the same path: explicit attention, with every member's `on_attention` fed the same
    probabilities, or the base implementation). Returns (1, q, h_q, d_v)."""
    if scaling is None:
        scaling = module.head_dim ** -0.5
    clock = trunk.clock
    explicit: list[tuple[Any, EvictingLayer]] = []  # (policy, layer) of the members that take the probabilities
    for j, member in enumerate(trunk.caches):
        layer = member.layers[module.layer_idx]
        t0 = clock() if clock is not None else 0.0
        if _hooks(module, member, layer, query, scaling, kwargs.get("softcap")) and member.policy.needs_attention:
            explicit.append((member.policy, layer))
        if clock is not None:
            trunk.hook_s[j] += clock() - t0
    if explicit and len(explicit) != len(trunk.caches):
        raise RuntimeError("a trunk's members take different attention paths (explicit vs base); group them apart")
    if explicit:
        def on_probs(p: torch.Tensor) -> None:  # p (1, h_kv, c, kv): read by every member, written by none
            for policy, layer in explicit:
                policy.on_attention(layer, p)

        return explicit_attention(query, key, value, scaling, kwargs.get("softcap"), on_probs)
    lead = trunk.caches[0]
    mask = _fit_mask(attention_mask, query.shape[-2], key.shape[-2], base, query.dtype, query.device, lead.masks)
    return base_fn(module, query, key, value, mask, scaling=scaling, **kwargs)[0]


def _make_wrapper(base: str) -> Callable[..., Any]:
    def kvbench_attention(module: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                          attention_mask: torch.Tensor | None, scaling: float | None = None, dropout: float = 0.0,
                          **kwargs: Any):
        base_fn = _base_function(module, base)
        cache = _ACTIVE.get()
        if isinstance(cache, TrunkCache):  # one forward shared by several runs' caches (every layer evicting)
            return _attend_trunk(module, cache, query, key, value, attention_mask, scaling, base, base_fn,
                                 dropout=dropout, **kwargs), None
        if isinstance(cache, BatchCache):
            # Each sample over its own layer, with its own mask (HF's was built for no cache: see BatchCache); the
            # batch's rows are then concatenated for o_proj. Every layer of a BatchCache is an EvictingLayer.
            rows = []
            for j, member in enumerate(cache.caches):
                layer = member.layers[module.layer_idx]
                rows.append(_attend(module, member, layer, query[j:j + 1], layer.keys, layer.values, None, scaling,
                                    base, base_fn, dropout=dropout, **kwargs))
            return torch.cat(rows), None
        layer = cache.layers[module.layer_idx] if cache is not None else None
        if not isinstance(layer, EvictingLayer):  # not a kvbench run, or a sliding layer HF bounds itself
            return base_fn(module, query, key, value, attention_mask, scaling=scaling, dropout=dropout, **kwargs)
        return _attend(module, cache, layer, query, key, value, attention_mask, scaling, base, base_fn,
                       dropout=dropout, **kwargs), None

    kvbench_attention.__name__ = f"kvbench_{base}"
    return kvbench_attention


def install(model: Any) -> str:
    """Route `model`'s attention through the kvbench wrapper (idempotent). Returns the implementation name."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, eager_mask, sdpa_mask

    impl = model.config._attn_implementation
    if impl.startswith("kvbench_"):
        return impl
    if impl not in ("sdpa", "eager"):
        raise ValueError(f"attention implementation '{impl}' is not supported; use sdpa or eager")
    name = f"kvbench_{impl}"
    AttentionInterface.register(name, _make_wrapper(impl))
    AttentionMaskInterface.register(name, sdpa_mask if impl == "sdpa" else eager_mask)
    model.set_attn_implementation(name)
    return name
