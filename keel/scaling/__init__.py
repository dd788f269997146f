"""Layer 4: isoFLOP sweeps, ladders, scaling-law fits and screening. Built by the scaling issue."""
