"""User-facing errors.

Everything a user can get wrong (a bad file, an unknown name, an impossible number)
raises :class:`MoesimError`. The CLI turns it into one line on stderr and exit code 2;
anything else escaping is a bug in moesim and keeps its traceback.
"""


class MoesimError(Exception):
    """A problem with the user's input, reported as one line without a traceback."""


class DoesNotFit(MoesimError):
    """A configuration that does not fit in the machine's memory (device or host): a what-if
    row that says so, never a best; a single replay's one-line error."""
