"""Building blocks shared by the model families: norms, rotary embeddings, attention, mixture of experts."""
