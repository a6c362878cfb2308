"""An explicit float64 Llama forward that attends to exactly the positions a kvbench run logged.

Shared by the engine and policy tests (the engine's invariant 2): the model's logits under eviction
must equal this re-implementation, driven by the kept positions of `generate(..., observer=Observer(trace=True))`.
"""

from __future__ import annotations

import math

import torch


def _rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def _rope(x: torch.Tensor, pos: torch.Tensor, theta: float) -> torch.Tensor:
    d = x.shape[-1]
    inv = 1.0 / (theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d))
    ang = pos.double().unsqueeze(-1) * inv  # (n, d/2)
    cos, sin = torch.cat([ang.cos(), ang.cos()], -1), torch.cat([ang.sin(), ang.sin()], -1)
    x1, x2 = x[..., : d // 2], x[..., d // 2:]
    return x * cos + torch.cat([-x2, x1], -1) * sin


def reference_logits(model, chunks: list[list[int]], trace: list[list[torch.Tensor | None]],
                     all_rows: bool = False) -> list[torch.Tensor]:
    """Llama forward in float64; chunk s attends, per layer and KV head, to exactly the positions that head held
    before it (`trace[s]`, padding -1 skipped), plus the chunk itself causally. Each chunk's last-position logits
    (vocab,), or with `all_rows` every position's (len(chunk), vocab)."""
    cfg = model.config
    sd = {k: v.double() for k, v in model.state_dict().items()}
    h_q, h_kv, d = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    theta, eps = cfg.rope_parameters["rope_theta"], cfg.rms_norm_eps
    kv: list[dict[int, tuple[torch.Tensor, torch.Tensor]]] = [{} for _ in range(cfg.num_hidden_layers)]
    out, seen = [], 0
    for s, chunk in enumerate(chunks):
        pos = torch.arange(seen, seen + len(chunk))
        x = sd["model.embed_tokens.weight"][torch.tensor(chunk)]  # (q, hidden)
        for li in range(cfg.num_hidden_layers):
            p = f"model.layers.{li}."
            h = _rms(x, sd[p + "input_layernorm.weight"], eps)
            q = _rope((h @ sd[p + "self_attn.q_proj.weight"].T).view(-1, h_q, d).transpose(0, 1), pos, theta)
            k = _rope((h @ sd[p + "self_attn.k_proj.weight"].T).view(-1, h_kv, d).transpose(0, 1), pos, theta)
            v = (h @ sd[p + "self_attn.v_proj.weight"].T).view(-1, h_kv, d).transpose(0, 1)
            for j, pj in enumerate(pos.tolist()):
                kv[li][pj] = (k[:, j], v[:, j])
            heads = []
            for hq in range(h_q):
                hk = hq // (h_q // h_kv)
                held = [] if trace[s][li] is None else [t for t in trace[s][li][0, hk].tolist() if t >= 0]
                rows = []
                for j, pj in enumerate(pos.tolist()):
                    visible = held + list(range(seen, pj + 1))
                    K = torch.stack([kv[li][t][0][hk] for t in visible])  # (m, d)
                    V = torch.stack([kv[li][t][1][hk] for t in visible])
                    rows.append(torch.softmax(K @ q[hq, j] / math.sqrt(d), dim=0) @ V)
                heads.append(torch.stack(rows))  # (q, d)
            x = x + torch.stack(heads, 1).reshape(len(chunk), h_q * d) @ sd[p + "self_attn.o_proj.weight"].T
            h = _rms(x, sd[p + "post_attention_layernorm.weight"], eps)
            mlp = torch.nn.functional.silu(h @ sd[p + "mlp.gate_proj.weight"].T) * (h @ sd[p + "mlp.up_proj.weight"].T)
            x = x + mlp @ sd[p + "mlp.down_proj.weight"].T
        final = _rms(x, sd["model.norm.weight"], eps)  # (q, hidden)
        out.append((final if all_rows else final[-1]) @ sd["lm_head.weight"].T)
        seen += len(chunk)
    return out
