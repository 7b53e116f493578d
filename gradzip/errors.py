"""Errors that reach the user as one line and exit code 2 (see :func:`gradzip.cli.main`)."""


class GradzipError(Exception):
    """Bad input or configuration: printed as one line by the CLI, exit code 2."""


class SpecError(GradzipError, ValueError):
    """A compressor spec, experiment spec or flag value that cannot be parsed or is out of range."""


class TrainingError(RuntimeError):
    """A run that cannot go on (e.g. every step skipped for non-finite gradients): one line, exit 1."""


class CommError(RuntimeError):
    """A collective failed: a peer died, timed out, or disagreed. The message names op and rank."""


class CommTimeout(CommError, TimeoutError):
    """A collective or init did not complete within its timeout."""
