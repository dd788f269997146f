"""Layer 2: the transformer and Mixture-of-Experts model in JAX. Built by the model and trainer
issue.
"""
