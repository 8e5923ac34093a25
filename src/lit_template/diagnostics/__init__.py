"""The machinery behind the template's callbacks, none of it a Lightning callback itself.

- ``report``: the one frame every finding uses (a JSON file in the run dir, one plain sentence on the console).
- ``checksum``: the replica fingerprints the sync check compares.
- ``hang/``: the hang doctor's watchdog thread, heartbeat files and diagnosis.
- ``profiling/``: step timing, window statistics and the profile report.
"""
