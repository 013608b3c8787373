"""Errors a user can cause. The CLI turns each into one line and exit code 2."""


class UserError(Exception):
    """A mistake in what the user asked for: the message says what is accepted."""


class ConstraintError(UserError):
    """A config that breaks one of its search space's constraints."""


class DatabaseError(UserError):
    """A results database that cannot be used (corrupt, not SQLite, locked for too long)."""


def stated(options: dict) -> dict:
    """The options of an FLA op's call set off FLA's defaults (None and False)."""
    return {name: value for name, value in options.items() if value is not None and value is not False}


def refuse_stated(error: type[Exception], by: str, **options) -> None:
    """Raise ``error`` for the first of ``options`` set off FLA's default: ``by`` does not take it."""
    for name in stated(options):
        raise error(f"{name} is not supported by {by}")
