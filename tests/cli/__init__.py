"""The command line: help, options, config files (runner/cli/)."""
