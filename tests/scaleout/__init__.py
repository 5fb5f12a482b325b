"""One batch over a real Ray cluster on loopback (runner/scaleout/)."""
