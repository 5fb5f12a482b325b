"""Policies under trial (wset), behind the same protocol as the default ones. They may import
the policies package's modules and each other; the default path never imports them
(import-linter): the registry loads one when it is named."""
