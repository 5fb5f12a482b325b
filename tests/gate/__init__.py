"""The admission gate, its order, per-rank windows, coalescing, task order (runner/gate/)."""
