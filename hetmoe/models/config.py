"""A model's ``config.json`` as an object with attribute access (no transformers needed at run time)."""

from __future__ import annotations

import json
from pathlib import Path


class ModelConfig(dict):
    """The parsed config.json; ``cfg.hidden_size`` reads ``cfg["hidden_size"]``."""

    def __getattr__(self, name):
        try:
            return self[name]
        except KeyError:
            raise AttributeError(f"config.json has no {name!r}") from None

    @classmethod
    def from_file(cls, path) -> "ModelConfig":
        return cls(json.loads(Path(path).read_text()))

    def first(self, *names, default=None):
        """The first of several spellings present (configs written by different transformers versions vary,
        e.g. num_experts / num_local_experts)."""
        for n in names:
            if self.get(n) is not None:
                return self[n]
        if default is None:
            raise AttributeError(f"config.json has none of {', '.join(names)}")
        return default

    @property
    def rope_theta(self) -> float:
        params = self.get("rope_parameters") or {}
        return float(params.get("rope_theta", self.get("rope_theta", 10000.0)))

    @property
    def head_dim_or_default(self) -> int:
        return self.get("head_dim") or self["hidden_size"] // self["num_attention_heads"]
