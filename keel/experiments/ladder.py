"""The tiny scaling ladder: an isoFLOP sweep of a tiny dense model on the bundled sample, fitted.

    tokenize (the quickstart's token cache, shared with it)
       └─> ladder-<budget>-<shape> x 9 (3 budgets x 3 sizes) ─> ladder-runs (runs.csv) ─> ladder

3 budgets (5e10, 1.25e11, 3.125e11 FLOPs) x 3 one-layer widths chosen by keel.scaling.sweep
around the prior optimum N ≈ sqrt(C / (6·r)), 7,609 steps and 3.9M tokens in all; `ladder` fits
the isoFLOP parabolas and N* = G·C^a, D* = H·C^b (Approach 2) and L(N, D) (Approach 3) and writes
isoflops.png, optimal.png and predicted_vs_actual.png. Minutes on 2 CPU cores (docs/scaling.md
has the measured time). Run it with `keel scaling ladder` (which also prints the fit) or
`keel run keel/experiments/ladder.py`; check a run against it with
`keel scaling ladder --compare RUN_DIR`.
"""

from __future__ import annotations

from keel.experiments.quickstart import tokens
from keel.model.config import ModelConfig
from keel.scaling.ladder import ladder_step
from keel.scaling.sweep import SweepConfig, sweep_steps
from keel.steps import output_of
from keel.train.config import Phase, TrainConfig
from keel.train.optim import OptimizerConfig
from keel.train.schedule import ScheduleConfig

BASE = TrainConfig(
    model=ModelConfig(
        vocab_size=4096, d_model=32, n_layers=1, n_heads=8, n_kv_heads=4, head_dim=4, ffn_dim=96
    ),
    optimizer=OptimizerConfig(name="adamw"),
    phases=(Phase(seq_len=64, schedule=ScheduleConfig(peak_lr=3e-3, warmup_steps=10)),),
    batch_size=8,
    eval_every=1000,
    eval_batches=16,
    checkpoint_every=100_000,  # one checkpoint, at the end
)
SWEEP = SweepConfig(
    base=BASE,
    budgets=(5e10, 1.25e11, 3.125e11),
    widths=(4, 8, 12, 16, 20, 24, 32, 40, 48, 64, 96, 128),  # d4: 5e10's optimum is near d8
    depths=(1,),
    points_per_budget=3,
    tokens_per_param=6.0,  # the 4,096-id embedding is most of N here: optima sit at larger N
    spacing=2.0,  # 3 bracketed 1.25e11 with d8, d12, d40: a flat, noisy minimum (docs/scaling.md)
)

sweep = sweep_steps(SWEEP, (output_of(tokens),), name="ladder")
ladder = ladder_step("ladder", sweep[-1], extrapolate_to=1e14)  # 320x the largest budget

STEPS = [ladder]
