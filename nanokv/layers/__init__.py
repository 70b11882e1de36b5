"""Building blocks of the models: linear layers, norms, rotary, activations, head, sampler."""
