"""Contracts with what the runner cannot run here or must not break: SGLang's surface and
source, the package rules."""
