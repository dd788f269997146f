"""Layer 1: the dataflow engine (lazy datasets, fused stages, shuffles; local and Ray backends).
Built by the flow issue.
"""
