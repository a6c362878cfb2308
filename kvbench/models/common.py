"""What every model source shares: where kvbench keeps what it builds or converts once (built-in models, converted
GGUF files), the size of a model's attention heads, and the error a model that cannot load raises.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any


def cache_root() -> Path:
    return Path(os.environ.get("KVBENCH_CACHE", Path.home() / ".cache" / "kvbench"))


def portable_path(path: str) -> str:
    """`path` as results record it: below the kvbench cache as `$KVBENCH_CACHE/...`, below the home directory as
    `~/...`, so committed result files name no machine's directories (hub ids and relative paths pass through)."""
    if not Path(path).is_absolute():
        return path
    for root, name in ((cache_root(), "$KVBENCH_CACHE"), (Path.home(), "~")):
        try:
            return f"{name}/{Path(path).resolve().relative_to(root.resolve()).as_posix()}"
        except ValueError:
            continue
    return path


def head_dim(cfg: Any) -> int:
    """The size of one attention head of a decoder config: its `head_dim`, else hidden_size / attention heads."""
    return getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads


class ModelError(ValueError):
    """A model that cannot be loaded; the CLI prints it as one line."""
