"""Chat text: chat templates and the token-in token-out turn deltas (template.py), the one
tool-call syntax (toolcall.py), the chat templates the runner ships (templates/).

Imports nothing of the project: engines, the agent and the exports all read it.
"""
