"""Layer 4.5: experiment records (the written account of one question: hypothesis, runs,
results), their run logs and reports. Below keel.cli and keel.dashboard, which both read them;
see docs/experiments.md.
"""
