"""The transformers internals kvbench relies on, in one place: what `model.generate(do_sample=False)` does to the
logits is built by GenerationMixin's private `_prepare_special_tokens` and `_get_logits_processor` (no public API
gives generate's processor list), so parity with generate needs them. tests/test_hf_adapter.py fails, naming the
method, when a transformers release changes their parameters; tests/test_protocol.py checks the tokens against
generate itself.
"""

from __future__ import annotations

import copy
from typing import Any, Iterable

import torch

# The private methods and the parameters kvbench passes them (tests/test_hf_adapter.py reads this).
PRIVATE_CALLS = {"_prepare_special_tokens": ("generation_config", "kwargs_has_attention_mask", "device", "batch_size"),
                 "_get_logits_processor": ("generation_config", "input_ids_seq_length", "encoder_input_ids", "device",
                                           "model_kwargs")}


def greedy_processors(model: Any, prompt: torch.Tensor, stop_ids: Iterable[int] = (), min_new_tokens: int = 0,
                      max_new_tokens: int = 0) -> Any:
    """The logits processors `model.generate(prompt, do_sample=False, eos_token_id=stop_ids,
    min_new_tokens=min_new_tokens, max_new_tokens=max_new_tokens)` applies: those the model's generation_config
    asks for (repetition_penalty, no_repeat_ngram_size, bad_words_ids, suppress_tokens, ...; official LongBench
    pred.py decodes through generate, so they apply there) plus min_new_tokens. Built by transformers' own
    `_get_logits_processor`, so the set, order and arguments are generate's (tests/test_protocol.py checks it
    token for token against generate). A LogitsProcessorList; call it with (1, seq) ids and (1, vocab) logits."""
    cfg = copy.deepcopy(model.generation_config)
    cfg.do_sample = False  # sampling warpers (temperature, top-p, ...) do not apply to greedy search
    cfg.eos_token_id = list(stop_ids) or None
    cfg.min_new_tokens = int(min_new_tokens) or None
    cfg.max_length = prompt.shape[-1] + int(max_new_tokens)  # as generate sets it (ForcedEOS reads it)
    model._prepare_special_tokens(cfg, kwargs_has_attention_mask=False, device=prompt.device, batch_size=1)
    return model._get_logits_processor(cfg, input_ids_seq_length=prompt.shape[-1], encoder_input_ids=prompt,
                                       device=prompt.device, model_kwargs={})


def describe_processors(processors: Iterable[Any]) -> list[dict[str, Any]]:
    """metrics.json form of a processor list: class name and scalar settings, e.g.
    {"name": "RepetitionPenaltyLogitsProcessor", "penalty": 1.05}."""
    return [{"name": type(p).__name__, **{k: v for k, v in vars(p).items()
                                          if isinstance(v, (bool, int, float, str)) and not k.startswith("_")}}
            for p in processors]


def generation_provenance(model: Any, config_source: str | None = None) -> dict[str, Any]:
    """metrics.json's record of how tokens are picked: greedy, with the generation_config's processors (each
    sample adds min_new_tokens and its stop tokens as eos, as a generate call with those arguments would), and
    `config_source`, where that generation_config came from (kvbench.models.loading.generation_config_source), so
    an empty processor list reads as "the model's files ask for none", not as a setting someone dropped."""
    prompt = torch.zeros(1, 1, dtype=torch.long, device=model.device)  # (1, 1): the processors' settings only
    out: dict[str, Any] = {"decoding": "greedy", "processors": describe_processors(greedy_processors(model, prompt))}
    if config_source is not None:
        out["config_source"] = config_source
    return out
