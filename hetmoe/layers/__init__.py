"""Building blocks shared by the models (attention, MoE, norms, rope, ...)."""
