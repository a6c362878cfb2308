"""What a benchmark runs on: a real model (a conf/model preset or an HF directory) with filler prose, or a
random-weight model with real attention geometry and a random prompt; the policies by name.
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

import torch

from kvbench.errors import error_line
from kvbench.models.common import head_dim

FLOOR = "streamingllm"


FULL = "full"


HF_FORWARD = "hf-forward"  # HF's loop: one forward over the whole prompt, then greedy decoding at that cache size


HF_DECODE = "hf-decode"  # HF's loop: a forward over N prompt tokens, then greedy decoding at cache size N


HF = "hf"  # --baselines name for both HF rows


BASELINES = (FULL, FLOOR, HF)


DEFAULT_POLICIES = ("keydiff", "h2o", "tova", "snapkv")


class BenchError(ValueError):
    """Bad bench input (unknown policy or architecture, unreadable config); printed as one line."""


def build_model(arch: str = "tiny-llama3", config: str | None = None, layers: int | None = None,
                dtype: str = "float32", device: str = "cpu", seed: int = 0) -> tuple[Any, str]:
    """A random-weight causal LM with the attention geometry of `arch` (a built-in tiny architecture) or of
    `config` (an HF config.json, a model directory, a hub id, or a conf/model preset name); `layers` overrides the
    number of layers. Returns (model on `device` with the kvbench attention installed, a short description)."""
    from kvbench.engine.cache import install
    from kvbench.models.loading import DTYPES, resolve_device
    from kvbench.models.tiny import TINY_ARCHS, build_tiny_model

    if dtype not in DTYPES or dtype == "auto":
        raise BenchError(f"unknown dtype '{dtype}'; choose one of: float32, bfloat16, float16")
    torch_dtype = DTYPES[dtype]
    over: dict[str, Any] = {"num_hidden_layers": layers} if layers else {}
    if config is not None:
        tiny = _preset_builtin(config)
        if tiny is not None:
            arch, config = tiny, None
    if config is None:
        if arch not in TINY_ARCHS:
            raise BenchError(f"unknown architecture '{arch}'; choose one of: {', '.join(sorted(TINY_ARCHS))}")
        model, _ = build_tiny_model(arch, seed=seed, dtype=torch_dtype, **over)
        name = arch
    else:
        model, name = _model_from_config(config, layers, torch_dtype, seed)
    model.to(resolve_device(device)).eval()
    install(model)
    cfg = model.config.get_text_config(decoder=True)
    desc = (f"{name}: {cfg.num_hidden_layers} layers, hidden {cfg.hidden_size}, {cfg.num_attention_heads}/"
            f"{cfg.num_key_value_heads} heads, head_dim {head_dim(cfg)}, {dtype}")
    return model, desc


def load_real_model(name: str, dtype: str | None = None, device: str = "cpu") -> tuple[Any, Any, str]:
    """A model with its own weights: a conf/model preset name (`smollm2-135m`, a hub id preset, ...) or a local HF
    directory. Returns (model with the kvbench attention installed, tokenizer, a short description)."""
    from kvbench.engine.cache import install
    from kvbench.models.common import ModelError
    from kvbench.models.loading import DTYPES, load_model
    from kvbench.run.config import CONF_DIR, load_group

    if "/" not in name and (CONF_DIR / "model" / f"{name}.yaml").is_file():
        spec = load_group("model", name)
    elif Path(name).is_dir():
        spec = {"name": "hf", "path": name}
    else:
        raise BenchError(f"unknown model '{name}': neither a conf/model preset nor a model directory")
    if dtype is not None and (dtype not in DTYPES or dtype == "auto"):
        raise BenchError(f"unknown dtype '{dtype}'; choose one of: float32, bfloat16, float16")
    try:
        loaded = load_model(name=str(spec.get("name", name)), path=str(spec["path"]),
                            dtype=dtype or str(spec.get("dtype") or "auto"), revision=spec.get("revision"),
                            attn_implementation=str(spec.get("attn_implementation", "sdpa")), device=device)
    except ModelError as e:
        raise BenchError(str(e)) from None
    model = loaded.model
    install(model)
    cfg = model.config.get_text_config(decoder=True)
    desc = (f"{loaded.name} (real weights): {cfg.num_hidden_layers} layers, hidden {cfg.hidden_size}, "
            f"{cfg.num_attention_heads}/{cfg.num_key_value_heads} heads, head_dim {head_dim(cfg)}, "
            f"{str(model.dtype).replace('torch.', '')}")
    return model, loaded.tokenizer, desc


def prompt_ids(n: int, vocab: int, tokenizer: Any = None, seed: int = 0) -> list[int]:
    """`n` prompt token ids: built-in filler prose through `tokenizer` (real models), else uniform random ids."""
    if tokenizer is None:
        g = torch.Generator().manual_seed(seed * 7919 + n)
        return torch.randint(2, vocab, (n,), generator=g).tolist()
    from kvbench.tasks.haystack import filler_text

    words = n
    while True:  # English prose is ~1.3 tokens per word; grow until the text is long enough
        ids = list(tokenizer(filler_text(words, seed), add_special_tokens=False)["input_ids"])
        if len(ids) >= n:
            return ids[:n]
        words *= 2


def _preset_path(config: str) -> str | None:
    """The `path` of the conf/model preset named `config` (read by the run's own YAML loader), or None."""
    from kvbench.run.config import group_choices, load_group

    if "/" in config or config not in group_choices("model"):
        return None
    return str(load_group("model", config).get("path") or "")


def _preset_builtin(config: str) -> str | None:
    """The tiny architecture a conf/model preset names (`path: builtin:<arch>`), or None."""
    path = _preset_path(config) or ""
    return path[len("builtin:"):].strip() if path.startswith("builtin:") else None


def _model_from_config(config: str, layers: int | None, dtype: torch.dtype, seed: int) -> tuple[Any, str]:
    from transformers import AutoConfig, AutoModelForCausalLM

    src = _preset_path(config) or config  # a preset: its path is a hub id or a local directory
    p = Path(src)
    if src.startswith(("/", ".", "~")) and not p.expanduser().exists():  # a path, not a hub id: say so plainly
        raise BenchError(f"cannot read model config '{config}': no such file or directory")
    try:
        cfg = AutoConfig.from_pretrained(str(p.parent if p.is_file() else src))
    except (OSError, ValueError) as e:
        raise BenchError(f"cannot read model config '{config}': {error_line(e)}") from None
    text = cfg.get_text_config(decoder=True)
    if layers:
        text.num_hidden_layers = layers
        if isinstance(getattr(text, "layer_types", None), list):
            text.layer_types = text.layer_types[:layers]
    # Random prompts need no real vocabulary; a 128k-entry embedding would only add memory that is not the cache's.
    text.vocab_size = 1024
    for k in ("bos_token_id", "eos_token_id", "pad_token_id"):
        if isinstance(getattr(text, k, None), int) and getattr(text, k) >= 1024:
            setattr(text, k, 1)
    text.tie_word_embeddings = False
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(text, dtype=dtype, attn_implementation="sdpa")
    return model, src


# A policy name ending so runs each forward with its eviction as one compiled graph (`keydiff+compiled`:
# GenerationSettings.compile), beside the eager row of the plain name.
COMPILED = "+compiled"
VARIANTS: dict[str, dict[str, bool]] = {COMPILED: {"compile": True}}


def variant(name: str) -> tuple[str, dict[str, bool]]:
    """A bench policy name -> (the policy's own name, the GenerationSettings its suffix sets)."""
    for suffix, settings in VARIANTS.items():
        if name.endswith(suffix):
            return name[:-len(suffix)], dict(settings)
    return name, {}


def base_name(name: str) -> str:
    """A bench policy name -> the policy's own name."""
    return variant(name)[0]


def make_policy(name: str, budget: int | None, seed: int) -> Any:
    from kvbench.run.config import load_group
    from kvbench.run.settings import RunSettings, build_policy

    name = base_name(name)
    try:
        spec = load_group("policy", name)
    except ValueError as e:
        raise BenchError(str(e)) from None
    return build_policy(spec, RunSettings(budget=budget if name != FULL else None, block=None, seed=seed))


@functools.cache  # evict_measured asks it for every row of every table: the YAML is read once a name
def policy_class(name: str) -> type:
    """The Policy class of conf/policy/NAME (a variant's suffix ignored)."""
    from kvbench.run.config import load_group
    from kvbench.run.settings import policy_class as of_config

    return of_config(load_group("policy", base_name(name)))


def all_policies() -> list[str]:
    """Every policy in conf/policy/ but the no-eviction `full`."""
    from kvbench.run.config import group_choices

    return [n for n in group_choices("policy") if n != FULL]
