"""Errors name what their reader can change: a flag on the command line, a parameter in the API.

The client library serves both. Its texts speak to a script's author by default (``timeout=``,
``deadline=``); the CLI switches them to its flags (``--timeout``, ``--deadline``) as it starts.
"""

__all__ = ["use_cli_words", "option"]

_cli = False


def use_cli_words() -> None:
    """From here on, errors name the CLI's flags (called once by the ``probe`` command)."""
    global _cli
    _cli = True


def option(flag: str, parameter: str) -> str:
    """``flag`` (``"--deadline"``) for the CLI, ``parameter`` (``"deadline="``) for the API."""
    return flag if _cli else parameter
