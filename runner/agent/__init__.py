"""The agent loop (agent.py: generate, call a tool, observe, in one small file), its
retries of engine errors (retries.py) and stopping a batch (stopping.py).

May import: engines.protocol, gate (the AdmissionGate interface), chat, tasks,
runfolder.records, tools.
"""
