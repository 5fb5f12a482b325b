"""Loading tasks, dataset formats, SWE-bench records (runner/tasks/)."""
