"""Any Transformers MoE model on hetmoe's CPU expert engine (docs/transformers.md).

Importing this package registers ``"hetmoe"`` in Transformers' experts interface (backend.py);
``from_pretrained(path, ...)`` (loading.py) returns a ``transformers.PreTrainedModel`` whose routed experts run on
``hetmoe.cpu.CPUExperts`` and whose other modules sit on the GPU when there is one; ``TransformersRunner``
(runner.py) serves such a model to the engine's scheduler (``hetmoe generate/chat/serve --model DIR`` for a
model_type without a hetmoe model file).
"""

from hetmoe.transformers.backend import NAME, FallbackWarning, hetmoe_experts_forward, register, unsupported
from hetmoe.transformers.loading import from_pretrained

register()

__all__ = ["NAME", "FallbackWarning", "hetmoe_experts_forward", "register", "unsupported", "from_pretrained"]
