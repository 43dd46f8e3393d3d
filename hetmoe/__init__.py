"""hetmoe: run giant Mixture-of-Experts language models on one GPU plus CPU DRAM.

``from hetmoe import LLM, EngineOptions, SamplingParams`` (imported lazily, so ``hetmoe --help`` stays fast).
Importing hetmoe has no side effects: the Transformers experts backend is registered by ``import hetmoe.transformers``
(docs/transformers.md).
"""

__version__ = "0.1.0"

_LAZY = {
    "LLM": "hetmoe.engine.llm",
    "EngineOptions": "hetmoe.config.options",
    "SamplingParams": "hetmoe.engine.sampler",
    "CPUExperts": "hetmoe.cpu",
}


def __getattr__(name):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'hetmoe' has no attribute {name!r}")
