"""The library's own errors: bad input or a refused action, each saying what and where.

Every error class of the library derives from `OccamyError`, so that a command turns any
of them into one `error:` line on stderr and exit status 2 (`occamy_mtp.cli`), while a
bug still shows its traceback.
"""


class OccamyError(Exception):
    """An error with a message meant for the user: the file, line, tensor or setting at fault, and what was expected."""
