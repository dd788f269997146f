"""Scores a nanoGPT checkpoint on a whole character-level split, in bits per UTF-8 byte.

This module runs only in nanoGPT's own virtual environment (it imports torch and nanoGPT's
model.py from a scratch copy of the peer); speedrun_bench.py starts it there as
`PEER_PYTHON -c "...; from nanogpt_score import main; main(ARGS)"`. It has no main block on
purpose: CI runs every benchmarks/*.py script with one under keel's venv, which has no torch.

What it computes: the split (val.bin, uint16 character ids, N of them) is cut into windows of
block_size + 1 ids that start every block_size ids (window k holds ids [k*T, k*T + T + 1)), so
each id after the first is a target exactly once and sees the ids before it in its window as
context (0 to T - 1 of them); the last, partial window is scored too. The summed negative
log-likelihood in bits is divided by the UTF-8 bytes of the scored characters (all but the
first), decoded through meta.pkl's itos. Prints one JSON line: nll_bits, bytes, chars, bpb,
iter_num (the checkpoint's step), best_val_loss (nanoGPT's own estimate when it saved).
"""

from __future__ import annotations

import argparse
import json
import math
import pickle
import sys
from pathlib import Path


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--nanogpt", type=Path, required=True, help="the scratch copy of nanoGPT")
    parser.add_argument("--checkpoint", type=Path, required=True, help="its ckpt.pt")
    parser.add_argument("--data", type=Path, required=True, help="the data dir (val.bin, meta.pkl)")
    parser.add_argument("--batch", type=int, default=64, help="windows per forward pass")
    arguments = parser.parse_args(argv)

    import numpy as np
    import torch
    import torch.nn.functional as F

    sys.path.insert(0, str(arguments.nanogpt))
    from model import GPT, GPTConfig

    checkpoint = torch.load(arguments.checkpoint, map_location="cpu")
    model = GPT(GPTConfig(**checkpoint["model_args"]))
    state = {key.removeprefix("_orig_mod."): value for key, value in checkpoint["model"].items()}
    model.load_state_dict(state)
    model.eval()
    block = model.config.block_size

    ids = np.fromfile(arguments.data / "val.bin", dtype=np.uint16).astype(np.int64)
    with open(arguments.data / "meta.pkl", "rb") as file:
        itos = pickle.load(file)["itos"]
    starts = list(range(0, len(ids) - 1, block))
    nll_nats = 0.0
    with torch.no_grad():
        for first in range(0, len(starts), arguments.batch):
            rows = starts[first : first + arguments.batch]
            inputs = torch.zeros((len(rows), block), dtype=torch.long)
            targets = torch.full((len(rows), block), -1, dtype=torch.long)
            for row, start in enumerate(rows):
                window = torch.from_numpy(ids[start : start + block + 1])
                inputs[row, : len(window) - 1] = window[:-1]
                targets[row, : len(window) - 1] = window[1:]
            logits, _ = model(inputs, targets)
            nll_nats += F.cross_entropy(
                logits.view(-1, logits.size(-1)), targets.view(-1), ignore_index=-1, reduction="sum"
            ).item()
    scored_text = "".join(itos[int(i)] for i in ids[1:])
    scored_bytes = len(scored_text.encode("utf-8"))
    nll_bits = nll_nats / math.log(2)
    best = checkpoint.get("best_val_loss")
    report = {
        "nll_bits": nll_bits,
        "bytes": scored_bytes,
        "chars": len(ids) - 1,
        "bpb": nll_bits / scored_bytes,
        "iter_num": int(checkpoint["iter_num"]),
        "best_val_loss": float(best) if best is not None else None,
    }
    print(json.dumps(report))
