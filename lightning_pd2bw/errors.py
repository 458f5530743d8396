"""``Refusal``: what the project raises when it will not do what it was asked, with a message that says what and the fix.

A refusal is not a bug: its message is the whole story. The command-line tools end with the message alone (no
traceback, no Hydra hint; ``HYDRA_FULL_ERROR=1`` shows the trace), and a program can catch ``Refusal`` to tell a
bad input from a failure. The kinds, each also the standard exception it refines:

* ``cli.checks.ConfigError`` (ValueError): a configuration that cannot run;
* ``checkpoint.UnreadableCheckpoint`` (ValueError): a checkpoint damaged, of another format, or crafted to run code;
* ``checkpoint.preflight.OutOfSpace`` (OSError, ENOSPC): a save that does not fit where it goes;
* ``planner.search.NoPlanFits`` (ValueError): no layout fits the devices' memory.
"""

from __future__ import annotations


class Refusal(Exception):
    """A request refused with its reason and fix; the message is complete without a traceback."""


def refusal_in(error: BaseException) -> Refusal | None:
    """The refusal ``error`` is or carries (a wrapper's ``__cause__``/``__context__``: Lightning, DCP), or None."""
    seen: set[int] = set()
    while error is not None and id(error) not in seen:
        if isinstance(error, Refusal):
            return error
        seen.add(id(error))
        error = error.__cause__ or error.__context__
    return None
