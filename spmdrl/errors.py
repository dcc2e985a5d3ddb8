"""The one error type for user mistakes (a leaf module: everything may import it)."""


class ConfigError(ValueError):
    """A user-facing configuration problem: printed as one line by the CLI, exit code 2."""
