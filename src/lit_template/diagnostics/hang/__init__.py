"""The hang doctor's parts that do not need Lightning: the watchdog thread, heartbeats, the diagnosis."""
