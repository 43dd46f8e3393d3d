"""hetmoe: run giant Mixture-of-Experts language models on one GPU plus CPU DRAM.

``from hetmoe import LLM, EngineOptions, SamplingParams`` (imported lazily, so ``hetmoe --help`` stays fast).
Importing hetmoe also registers ``"hetmoe"`` in Transformers' experts interface (hetmoe/transformers/), the moment
Transformers' MoE integration is imported, so a script that never uses Transformers never loads it.
"""

import importlib.abc
import importlib.util
import sys

__version__ = "0.1.0"

_LAZY = {
    "LLM": "hetmoe.engine.llm",
    "EngineOptions": "hetmoe.plan.placement",
    "SamplingParams": "hetmoe.engine.sequence",
    "CPUExperts": "hetmoe.cpu",
}


def __getattr__(name):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'hetmoe' has no attribute {name!r}")


_TRANSFORMERS_MOE = "transformers.integrations.moe"


def _register_experts_backend() -> None:
    try:
        from hetmoe.transformers.backend import register

        register()
    except Exception as err:  # never break the user's Transformers import
        print(f"hetmoe: could not register the hetmoe experts backend with Transformers: {err}", file=sys.stderr)


class _RegisterAfterImport(importlib.abc.MetaPathFinder):
    """A one-shot import hook: runs the registration right after Transformers' MoE integration module loads."""

    def find_spec(self, name, path=None, target=None):
        if name != _TRANSFORMERS_MOE:
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        if spec is not None and spec.loader is not None and hasattr(spec.loader, "exec_module"):
            exec_module = spec.loader.exec_module

            def exec_and_register(module):
                exec_module(module)
                sys.modules[name] = module
                _register_experts_backend()

            spec.loader.exec_module = exec_and_register
        return spec


if _TRANSFORMERS_MOE in sys.modules:
    _register_experts_backend()
elif not any(isinstance(f, _RegisterAfterImport) for f in sys.meta_path):
    sys.meta_path.insert(0, _RegisterAfterImport())
