"""Errors a user can fix. The CLI prints them as one line and exits with status 2."""


class UserError(Exception):
    """Bad input: the message names the problem and the fix."""


class UnsupportedModelError(UserError):
    """The source model uses something we do not convert (yet)."""
