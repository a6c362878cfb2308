"""The probe model: a hand-wired 2-layer Llama that retrieves `key -> value` exactly (no training, no randomness).

Vocabulary (word level): `<s> </s> <unk>`, 131 filler words, keys `k000..k127`, values `v000..v127`.
A prompt `<s> filler.. kXXX vYYY filler.. filler kXXX` makes the model answer `vYYY`; if the needle's
evidence is gone (layer-1 KV of the VALUE token evicted, or the KEY's layer-0 KV missing when the VALUE was
processed) it answers `</s>` ("not found") instead. See docs/probe-model.md for the circuit and its limits.

Residual stream (d = 576), one-hot codes, every embedding row = u_C + u_token so all rows have equal norm:
    dim 0            C: constant 1 (supplies content-independent q/k in layer 0 and the abstain logit)
    dims 1..390      token identity (token id t -> dim 1 + t)
    dims 391..518    P: "the previous token was key i" (written by layer 0)
    dims 519..575    unused
Layer 0 is a previous-token head built from RoPE's fast planes; layer 1 is an induction head whose q/k codes
live in RoPE's near-static planes. MLPs are zero. Variant B adds a constant key offset in layer 1 that no
query reads: retrieval is identical, but the cached keys' norms/directions (what K-norm or KeyDiff score)
flip, which is exactly why key-geometry policies cannot be ranked on this model.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import shutil
import sys
from pathlib import Path
from typing import Any

import torch

# Bump when the construction or the saved files change, so cached builds are not reused across versions.
GENERATOR_VERSION = 1
VARIANTS = ("A", "B")
META_FILE = "probe_meta.json"

SPECIALS = ["<s>", "</s>", "<unk>"]
FILLERS = (
    "the of and to in is was that for it as with his on be at by this had not are but from or have an they "
    "which one you were her all she there would their we him been has when who will more no if out so said "
    "what up its about into than them can only other new some could time these two may then do first any my "
    "now such like our over man me even most made after also did many before must through back years where "
    "much your way well down should because each just those people how too little state good very make world "
    "still own see men work long get here between both life being under never day same another know while last"
).split()
N_KEYS = 128
KEYS = [f"k{i:03d}" for i in range(N_KEYS)]
VALUES = [f"v{i:03d}" for i in range(N_KEYS)]
VOCAB = SPECIALS + FILLERS + KEYS + VALUES
BOS_ID, EOS_ID, UNK_ID = 0, 1, 2
FILLER_IDS = list(range(len(SPECIALS), len(SPECIALS) + len(FILLERS)))
KEY_IDS = list(range(FILLER_IDS[-1] + 1, FILLER_IDS[-1] + 1 + N_KEYS))
VALUE_IDS = list(range(KEY_IDS[-1] + 1, KEY_IDS[-1] + 1 + N_KEYS))

HIDDEN = 576
HEAD_DIM = 256
HALF = HEAD_DIM // 2  # HF rotates the pair (dim p, dim p + 128) by angle n * theta_p
ROPE_THETA = 1e12
RMS_EPS = 1e-6
DIM_C = 0
DIM_TOKEN0 = 1
DIM_P0 = DIM_TOKEN0 + len(VOCAB)  # 391
N_FAST_PLANES = 64  # planes 0..63 turn by 1 .. 1.2e-6 rad per token; 64..127 are near-static
# Layer-0 amplitude: the worst non-previous offset loses sum_p (1 - cos((delta - 1) theta_p)) >= 1.356 of
# a^2/sqrt(256) logits, so a^2 = 472 gives a margin of ~40 over every other position (>> ln 65536 = 11).
A_PREV = math.sqrt(472.0)
# Layer-1 amplitude: the matching (query key, needle value) pair scores s^2/sqrt(256) = 50, everything else 0.
S_MATCH = math.sqrt(800.0)
VALUE_GAIN = 2.0  # layer-1 OV writes 2 * attention weight into the answer's E_val dim
ABSTAIN = 0.5  # </s> logit reads C: a value wins only with more than ABSTAIN / VALUE_GAIN = 25 % attention
B_PLANE = 60  # variant B's constant key offset: a near-static plane that no layer-1 query uses
B_OFFSET = 3.0  # in units of S_MATCH


def _assert_layout() -> None:
    assert len(FILLERS) == 131 and len(set(VOCAB)) == len(VOCAB) == 390, "probe vocabulary must have 390 words"
    assert DIM_P0 + N_KEYS <= HIDDEN


def _norm_scale(n_ones: int) -> float:
    """The factor RMSNorm applies to a residual made of `n_ones` unit one-hot coordinates."""
    return 1.0 / math.sqrt(n_ones / HIDDEN + RMS_EPS)


def _slot(i: int) -> int:
    """Layer-1 q/k dimension of key i: both halves of the near-static planes 64..127."""
    return 64 + i if i < 64 else 192 + (i - 64)


def config_dict() -> dict[str, Any]:
    return dict(vocab_size=len(VOCAB), hidden_size=HIDDEN, num_hidden_layers=2, num_attention_heads=1,
                num_key_value_heads=1, head_dim=HEAD_DIM, intermediate_size=8,
                rope_parameters={"rope_type": "default", "rope_theta": ROPE_THETA}, rms_norm_eps=RMS_EPS,
                tie_word_embeddings=False, attention_bias=False, mlp_bias=False, max_position_embeddings=65536,
                bos_token_id=BOS_ID, eos_token_id=EOS_ID, pad_token_id=None, hidden_act="silu")


def build_state_dict(variant: str = "A") -> dict[str, torch.Tensor]:
    """All weights of the probe model (float32), keyed as `LlamaForCausalLM` expects them."""
    _check_variant(variant)
    _assert_layout()
    f64 = torch.float64
    n2 = _norm_scale(2)  # a token without P: C + identity
    n3 = _norm_scale(3)  # a VALUE right after a key: C + identity + P
    sd: dict[str, torch.Tensor] = {}

    emb = torch.zeros(len(VOCAB), HIDDEN, dtype=f64)
    emb[:, DIM_C] = 1.0
    emb[torch.arange(len(VOCAB)), DIM_TOKEN0 + torch.arange(len(VOCAB))] = 1.0
    sd["model.embed_tokens.weight"] = emb

    for layer in range(2):
        q = torch.zeros(HEAD_DIM, HIDDEN, dtype=f64)
        k = torch.zeros(HEAD_DIM, HIDDEN, dtype=f64)
        v = torch.zeros(HEAD_DIM, HIDDEN, dtype=f64)
        o = torch.zeros(HIDDEN, HEAD_DIM, dtype=f64)
        if layer == 0:
            # Previous-token head: q0 = a (1, 0), k0 = a (cos th, sin th) in every fast plane, for every token,
            # so q_n . k_m = a^2 sum_p cos((n - m - 1) th_p), maximal at m = n - 1.
            for p in range(N_FAST_PLANES):
                th = ROPE_THETA ** (-p / HALF)
                q[p, DIM_C] = A_PREV / n2
                k[p, DIM_C] = A_PREV * math.cos(th) / n2
                k[p + HALF, DIM_C] = A_PREV * math.sin(th) / n2
            # OV copies the previous token's key identity into P (fillers, values and specials copy nothing).
            for i, tid in enumerate(KEY_IDS):
                v[i, DIM_TOKEN0 + tid] = 1.0 / n2
                o[DIM_P0 + i, i] = 1.0
        else:
            # Induction head: the final key k_i queries slot(i); the needle VALUE carries P_i, keyed at slot(i).
            for i, tid in enumerate(KEY_IDS):
                q[_slot(i), DIM_TOKEN0 + tid] = S_MATCH / n2
                k[_slot(i), DIM_P0 + i] = S_MATCH / n3
            if variant == "B":
                k[B_PLANE, DIM_C] = B_OFFSET * S_MATCH / n2
            # OV copies the attended VALUE identity (x2) into E_val, reused as the answer read-out space.
            for j, tid in enumerate(VALUE_IDS):
                v[j, DIM_TOKEN0 + tid] = VALUE_GAIN / n3
                o[DIM_TOKEN0 + tid, j] = 1.0
        pre = f"model.layers.{layer}."
        sd[pre + "self_attn.q_proj.weight"] = q
        sd[pre + "self_attn.k_proj.weight"] = k
        sd[pre + "self_attn.v_proj.weight"] = v
        sd[pre + "self_attn.o_proj.weight"] = o
        sd[pre + "mlp.gate_proj.weight"] = torch.zeros(8, HIDDEN, dtype=f64)
        sd[pre + "mlp.up_proj.weight"] = torch.zeros(8, HIDDEN, dtype=f64)
        sd[pre + "mlp.down_proj.weight"] = torch.zeros(HIDDEN, 8, dtype=f64)
        sd[pre + "input_layernorm.weight"] = torch.ones(HIDDEN, dtype=f64)
        sd[pre + "post_attention_layernorm.weight"] = torch.ones(HIDDEN, dtype=f64)
    sd["model.norm.weight"] = torch.ones(HIDDEN, dtype=f64)

    head = torch.zeros(len(VOCAB), HIDDEN, dtype=f64)
    for tid in VALUE_IDS:
        head[tid, DIM_TOKEN0 + tid] = 1.0
    head[EOS_ID, DIM_C] = ABSTAIN  # "not found" unless >= 25 % of layer-1 attention lands on a needle VALUE
    sd["lm_head.weight"] = head
    return {name: t.to(torch.float32).contiguous() for name, t in sd.items()}


def build_tokenizer():
    """Word-level `PreTrainedTokenizerFast` over the probe vocabulary; adds `<s>` like Llama."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(VOCAB)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##", cleanup=False)  # joins words with single spaces
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", pair="<s> $A <s> $B",
                                                       special_tokens=[("<s>", BOS_ID)])
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>",
                                   model_max_length=65536)


def metadata(variant: str) -> dict[str, Any]:
    return {
        "probe_model": True,
        "generator_version": GENERATOR_VERSION,
        "variant": variant,
        "bos_id": BOS_ID,
        "eos_id": EOS_ID,
        "abstain_id": EOS_ID,
        "filler_ids": FILLER_IDS,
        "key_ids": KEY_IDS,
        "value_ids": VALUE_IDS,
        "note": "hand-wired retrieval circuit with synthetic key geometry; see docs/probe-model.md",
    }


def write_probe_model(out_dir: str | Path, variant: str = "A") -> Path:
    """Write the probe model as a standard HF directory (config, safetensors, tokenizer, generation config,
    probe_meta.json). Same variant -> same bytes."""
    from safetensors.torch import save_file
    from transformers import GenerationConfig, LlamaConfig

    _check_variant(variant)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    cfg = LlamaConfig(**config_dict())
    cfg.architectures = ["LlamaForCausalLM"]
    cfg.dtype = "float32"
    cfg.save_pretrained(out)
    gen = GenerationConfig(bos_token_id=BOS_ID, eos_token_id=EOS_ID, pad_token_id=EOS_ID, do_sample=False)
    gen.save_pretrained(out)
    save_file(build_state_dict(variant), str(out / "model.safetensors"), metadata={"format": "pt"})
    build_tokenizer().save_pretrained(out)
    (out / META_FILE).write_text(json.dumps(metadata(variant), indent=1) + "\n", encoding="utf-8")
    return out


def _check_variant(variant: str) -> None:
    if variant not in VARIANTS:
        from kvbench.models.common import ModelError

        raise ModelError(f"unknown probe model variant '{variant}'; choose one of: {', '.join(VARIANTS)}")


def probe_dir(variant: str = "A") -> Path:
    """Directory of the probe model `variant` under the kvbench cache; built on first use, then reused."""
    from kvbench.models.common import cache_root

    _check_variant(variant)
    key = hashlib.sha256(json.dumps([GENERATOR_VERSION, variant], sort_keys=True).encode()).hexdigest()[:12]
    out = cache_root() / "models" / f"probe-{variant}-{key}"
    if (out / META_FILE).is_file():
        return out
    # Build next to the target and rename, so a concurrent or interrupted build never leaves a half directory.
    tmp = out.with_name(f"{out.name}.tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    write_probe_model(tmp, variant)
    try:
        tmp.rename(out)
    except OSError:
        if not (out / META_FILE).is_file():
            raise
        shutil.rmtree(tmp, ignore_errors=True)  # another process finished first
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="kvbench-probe-model",
                                 description="Write the hand-wired key->value retrieval model as an HF directory.")
    ap.add_argument("out_dir", help="output directory (created; existing probe files are overwritten)")
    ap.add_argument("--variant", default="A", choices=VARIANTS,
                    help="A: plain; B: same retrieval, constant layer-1 key offset (flips K-norm/KeyDiff)")
    args = ap.parse_args(argv)
    out = write_probe_model(args.out_dir, args.variant)
    print(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
