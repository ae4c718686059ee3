"""The one error type of graftlab, importable without torch (the workflow parse imports it)."""


class GraftlabError(Exception):
    """A user-facing failure; its message is one line naming the offending key, file or tensor."""
