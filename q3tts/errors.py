"""The errors a user's request can raise, carrying the parameter at fault so that each front end (Python, the
command line, the HTTP server) can name it its own way."""

from __future__ import annotations

import difflib
import os
import re
import sys
import warnings

_PACKAGE = os.path.dirname(os.path.abspath(__file__)) + os.sep


class RequestError(ValueError):
    """A request that cannot run as given. `param` names the offending argument as the Python API spells it
    (`text`, `speaker`, `max_new_tokens`, ...); the message names arguments in backticks, so that `renamed` can
    put another front end's names in their place."""

    def __init__(self, message: str, param: str | None = None, code: str = "invalid_value"):
        """code: "invalid_value", "missing" (a required argument is absent), "not_found" (it names
        something that does not exist, e.g. a speaker) or "too_long" (it is over a limit of length, e.g. a live
        request's text)."""
        super().__init__(message)
        self.message, self.param, self.code = message, param, code

    def renamed(self, names: dict[str, str]) -> str:
        return renamed(self.message, names)


def renamed(message: str, names: dict[str, str]) -> str:
    """`message` with each argument name in `names` (backticked, or a bare name with an underscore, e.g.
    max_new_tokens, optionally with "=value") replaced by its value; not inside a path or file name
    ("/data/ref_audio.wav" stays)."""
    def swap(match: re.Match) -> str:
        name, value = match.group(1) or match.group(2), match.group(3) or ""
        if name + value in names:  # e.g. "do_sample=False" -> "--greedy"
            return names[name + value]
        return names[name] + value if name in names else match.group(0)

    return re.sub(r"`([A-Za-z_]+)`|(?<![\w/.\\-])([a-z]+(?:_[a-z0-9]+)+)(?![\w/\\-]|\.\w)(=\w+)?", swap, message)


def quote(value: object, limit: int = 40) -> str:
    """repr() of what a caller sent, cut to `limit` characters: error messages never echo unbounded input."""
    text = value if isinstance(value, str) else repr(value)
    if len(text) <= limit:
        return repr(value)
    return repr(text[:limit]) + f"... ({len(text)} characters)"


def did_you_mean(name: str, known) -> str:
    """" (did you mean `x`?)" naming the closest of `known` to a misspelled `name`, or "" when none is close."""
    close = difflib.get_close_matches(name, list(known), n=1)
    return f" (did you mean `{close[0]}`?)" if close else ""


class RequestTypeError(RequestError, TypeError):
    """A request argument of the wrong type or name."""


def warn_caller(message: str) -> None:
    """A UserWarning attributed to the first caller outside this package (the user's line)."""
    frame, level = sys._getframe(1), 2  # (stacklevel 2: warn_caller's caller)
    while frame is not None and os.path.abspath(frame.f_code.co_filename).startswith(_PACKAGE):
        frame, level = frame.f_back, level + 1
    warnings.warn(message, stacklevel=level)


class AudioError(RequestError):
    """Reference audio that cannot be used: unreadable, empty, silent, too long, non-finite, or of an unsupported
    kind. A `RequestError` whose `param` is the reference audio's argument."""

    def __init__(self, message: str, param: str | None = "ref_audio", code: str = "invalid_value"):
        super().__init__(message, param, code)
