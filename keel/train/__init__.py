"""Layer 3: the trainer loop, optimizers, schedules, phases, checkpoints and evaluation. Built by
the model and trainer issue.
"""
