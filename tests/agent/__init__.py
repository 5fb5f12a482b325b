"""The agent loop: retries, prefix reuse, step budgets (runner/agent/)."""
