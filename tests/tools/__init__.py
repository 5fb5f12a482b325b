"""The tools and the sandbox, with real attacks, cgroups, uids and an unprivileged user (tools/)."""
