"""Policies under trial (wset, wset2), behind the same protocol as the default ones. They
may import policies.protocol, policies.aimd and each other; the default path never imports
them (import-linter): the registry loads one when it is named."""
