"""Errors a user fixes by changing their input; the CLI prints them as `raylm: error: ...`."""


class ConfigError(ValueError):
    """A configuration value or key that cannot be used; the message names it."""
