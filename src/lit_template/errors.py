"""The package's one user-error type.

Raised for anything the user can fix (a config option, a missing file, an environment variable). The entry points
catch it and print its message without a traceback; everything else is a bug and keeps its traceback.
"""


class ConfigError(Exception):
    """A user-fixable problem. The message names the option or variable and says what to do."""
