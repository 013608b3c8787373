"""Errors a user can cause. The CLI turns each into one line and exit code 2."""


class UserError(Exception):
    """A mistake in what the user asked for: the message says what is accepted."""


class ConstraintError(UserError):
    """A config that breaks one of its search space's constraints."""


class DatabaseError(UserError):
    """A results database that cannot be used (corrupt, not SQLite, locked for too long)."""
