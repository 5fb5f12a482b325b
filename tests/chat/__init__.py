"""The tool-call syntax and chat templates (runner/chat/)."""
