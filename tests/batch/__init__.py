"""The batch: orchestration, progress, workspaces (runner/batch/)."""
