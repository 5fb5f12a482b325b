"""The policies, the default and the experiments (runner/policies/)."""
