"""Layer 2: the job controller, its backends (local, Slurm, Ray) and federation. Built by the
cluster issue.
"""
