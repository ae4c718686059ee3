"""graftlab's error types, importable without torch (the workflow parse imports them)."""


class GraftlabError(Exception):
    """A user-facing failure of the data: its message is one line naming the offending file, key, row or
    tensor. `graftlab` exits with status 1."""


class UsageError(GraftlabError):
    """A user-facing failure of the command line: a flag's value, flags that contradict each other, an output
    that is an input. `graftlab` exits with status 2, as argparse does."""
