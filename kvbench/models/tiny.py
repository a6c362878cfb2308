"""Built-in tiny random models for tests: a small byte-level tokenizer, configs of every supported architecture,
and models saved once into the cache (`builtin:<arch>`) so they load through the same code path as real ones.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any

import torch

from kvbench.models.common import ModelError, cache_root, head_dim

_CORPUS = """\
The quick brown fox jumps over the lazy dog. A journey of a thousand miles begins with a single step.
In the beginning of the project the engineers measured everything twice and wrote down what they saw.
Memory is the budget; attention is the currency; the cache keeps what the policy believes will matter.
One of the special magic numbers for the city is 1234567. What is the best thing to do in San Francisco?
The best thing to do in San Francisco is eat a sandwich and sit in Dolores Park on a sunny day.
Answer the question based on the given passages. Only give me the answer and do not output any other words.
Question: Who wrote the report? Answer: The committee wrote the report after three months of work.
def main():\n    return 0\n\nclass Model:\n    def forward(self, x):\n        return x + 1\n
0 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18 19 20 42 100 1000 2048 4096 8192 65536
Paragraph 1: the river runs north. Paragraph 2: the mountain stands tall. Paragraph 3: the valley is green.
Summarize the following dialogue. Speaker A: hello there. Speaker B: good morning, how are you today?
""" * 4 + "\u4e2d\u6587\u7684\u95ee\u9898\u548c\u7b54\u6848\u3002\u8fd9\u662f\u4e00\u4e2a\u6d4b\u8bd5\u3002" * 8


_CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}<|end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)


def build_tiny_tokenizer(vocab_size: int = 512):
    """A deterministic byte-level BPE tokenizer (`PreTrainedTokenizerFast`) with `<s>`, `</s>`, `<unk>`, `<pad>`.

    BOS is added by default (like Llama); the chat template is a simple role-tagged format.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    specials = ["<s>", "</s>", "<unk>", "<pad>", "<|user|>", "<|assistant|>", "<|system|>", "<|end|>"]
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=specials, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator([_CORPUS], trainer=trainer)
    bos = tok.token_to_id("<s>")
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", pair="<s> $A <s> $B",
                                                       special_tokens=[("<s>", bos)])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>",
                                   pad_token="<pad>", additional_special_tokens=specials[4:])
    fast.chat_template = _CHAT_TEMPLATE
    return fast


TINY_ARCHS: dict[str, dict[str, Any]] = {
    "tiny-llama": {"model_type": "llama", "hidden_size": 256, "num_hidden_layers": 2, "num_attention_heads": 4,
                   "num_key_value_heads": 2, "head_dim": 64, "intermediate_size": 512},
    "tiny-llama-4l": {"model_type": "llama", "hidden_size": 256, "num_hidden_layers": 4, "num_attention_heads": 4,
                      "num_key_value_heads": 2, "head_dim": 64, "intermediate_size": 512},
    "tiny-qwen2": {"model_type": "qwen2", "hidden_size": 256, "num_hidden_layers": 2, "num_attention_heads": 4,
                   "num_key_value_heads": 2, "intermediate_size": 512},
    "tiny-qwen3": {"model_type": "qwen3", "hidden_size": 256, "num_hidden_layers": 2, "num_attention_heads": 4,
                   "num_key_value_heads": 2, "head_dim": 64, "intermediate_size": 512},
    "tiny-mistral": {"model_type": "mistral", "hidden_size": 256, "num_hidden_layers": 2, "num_attention_heads": 4,
                     "num_key_value_heads": 2, "head_dim": 64, "intermediate_size": 512, "sliding_window": None},
    "tiny-phi3": {"model_type": "phi3", "hidden_size": 256, "num_hidden_layers": 2, "num_attention_heads": 4,
                  "num_key_value_heads": 2, "intermediate_size": 512, "pad_token_id": 3},
    "tiny-gemma": {"model_type": "gemma", "hidden_size": 256, "num_hidden_layers": 2, "num_attention_heads": 4,
                   "num_key_value_heads": 2, "head_dim": 64, "intermediate_size": 512},
    # Llama-3.2-3B attention geometry (head_dim 128, 24 query / 8 KV heads, rope_theta 5e5) in few layers.
    "tiny-llama3": {"model_type": "llama", "hidden_size": 3072, "num_hidden_layers": 2, "num_attention_heads": 24,
                    "num_key_value_heads": 8, "head_dim": 128, "intermediate_size": 1024,
                    "rope_parameters": {"rope_type": "default", "rope_theta": 500000.0}},
}


def tiny_config(arch: str, vocab_size: int, **overrides: Any):
    """A transformers config for a built-in tiny architecture."""
    from transformers import AutoConfig

    if arch not in TINY_ARCHS:
        raise ModelError(f"unknown built-in model '{arch}'; choose one of: {', '.join(sorted(TINY_ARCHS))}")
    kw = dict(TINY_ARCHS[arch])
    model_type = kw.pop("model_type")
    kw.update(vocab_size=vocab_size, max_position_embeddings=262144, bos_token_id=0, eos_token_id=1,
              tie_word_embeddings=False)
    kw.update(overrides)
    return AutoConfig.for_model(model_type, **kw)


def build_tiny_model(arch: str, seed: int = 0, dtype: torch.dtype = torch.float32, locality: bool = True,
                     output_scale: float = 8.0, **overrides: Any):
    """(model, tokenizer) with random weights drawn from `seed`; deterministic across runs.

    Plain random weights give near-uniform next-token distributions and attention spread evenly over the whole
    context, so every eviction looks equally catastrophic. Two changes make the tiny models behave more like
    trained ones without training: a larger output scale (peaked next-token distributions) and, with
    `locality`, a recency prior in attention: every token carries a constant embedding component that q and k
    project into one low-frequency RoPE plane, adding ~cos(theta * distance) to each logit.
    """
    from transformers import AutoModelForCausalLM

    tok = build_tiny_tokenizer()
    cfg = tiny_config(arch, vocab_size=len(tok), **overrides)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(cfg, dtype=dtype)
    with torch.no_grad(), torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed + 1)
        for name, p in model.named_parameters():
            if name.endswith(("q_proj.weight", "k_proj.weight")):
                p.normal_(0.0, 0.12)  # peaked, varied attention patterns
        model.get_output_embeddings().weight.mul_(output_scale)
        if locality:
            _add_recency_prior(model)
    model.generation_config.eos_token_id = tok.eos_token_id
    model.generation_config.bos_token_id = tok.bos_token_id
    model.generation_config.pad_token_id = tok.pad_token_id
    model.eval()
    return model, tok


def _add_recency_prior(model: Any, strength: float = 0.7, wavelength: float = 1000.0) -> None:
    """Route a constant embedding dimension (0) into the RoPE plane whose angle per token is ~1/wavelength."""
    import math

    cfg = model.config
    layers = model.model.layers
    if not all(hasattr(layer.self_attn, "q_proj") and hasattr(layer.self_attn, "k_proj") for layer in layers):
        return  # fused projections (Phi-3): keep plain random weights
    d = head_dim(cfg)
    theta = (getattr(cfg, "rope_parameters", None) or {}).get("rope_theta", 10000.0)
    plane = min(d // 2 - 1, round(d / 2 * math.log(wavelength) / math.log(theta)))
    emb = model.get_input_embeddings().weight  # (vocab, hidden)
    emb[:, 0] = 16 * emb[:, 1:].std()  # about half of each embedding's norm
    for layer in layers:
        for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj):
            for h in range(proj.out_features // d):
                for r in (h * d + plane, h * d + plane + d // 2):
                    proj.weight[r].zero_()
                    proj.weight[r, 0] = strength


def builtin_dir(arch: str, seed: int = 0) -> Path:
    """Directory holding the saved built-in model `arch` (built on first use, then reused)."""
    key = hashlib.sha256(json.dumps([arch, seed, TINY_ARCHS.get(arch)], sort_keys=True).encode()).hexdigest()[:12]
    out = cache_root() / "models" / f"{arch}-s{seed}-{key}"
    if not (out / "config.json").is_file():
        model, tok = build_tiny_model(arch, seed=seed)
        tmp = out.with_name(out.name + f".tmp{os.getpid()}")
        model.save_pretrained(tmp)
        tok.save_pretrained(tmp)
        tmp.rename(out) if not out.exists() else None
    return out
