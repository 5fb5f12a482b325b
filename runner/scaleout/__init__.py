"""One batch over many nodes on Ray: a driver that owns the run folder (driver.py), workers
that each own a whole runner (worker.py), the messages between them (protocol.py) and the
book of tasks (ledger.py). See docs/scale-out.md."""
