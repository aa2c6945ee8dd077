"""No secret in any log line: API keys in URLs (`?api_key=`), `Authorization` values and
WebSocket bearer subprotocols are replaced by `[redacted]` in every record that passes through
the handlers of Sluice's and uvicorn's loggers (uvicorn's access and WebSocket lines included).
"""

from __future__ import annotations

import logging
import re

_SECRETS = re.compile(
    r"(?P<prefix>(?:[?&;]|\b)(?:api[_-]?key|access_token|token)=)[^&\s\"'#]+"
    r"|(?P<scheme>\b(?:Bearer|Basic)\s+)[^\s\"',;]+"
    r"|(?P<protocol>sluice\.bearer\.)[^\s\"',;]+",
    re.IGNORECASE,
)
REDACTED = "[redacted]"
# Loggers whose handlers see every record written: the root (Sluice's own loggers propagate to
# it) and uvicorn's, which do not propagate.
LOGGERS = ("", "uvicorn", "uvicorn.error", "uvicorn.access", "sluice.access")


# Every secret `_SECRETS` finds holds one of these, casefolded (its case-blind match also
# takes a dotless i, U+0131, for i): a line without them is not searched (the pattern's alternatives
# cost ~25 µs on an access line; these, about 1).
_MARKS = ("key=", "token=", "bearer", "basic", "bas\u0131c")


def redact(text: str) -> str:
    folded = text.casefold()
    if not any(mark in folded for mark in _MARKS):
        return text
    return _SECRETS.sub(
        lambda m: (m.group("prefix") or m.group("scheme") or m.group("protocol")) + REDACTED, text
    )


class RedactSecrets(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        clean = redact(message)
        if clean != message:
            record.msg, record.args = clean, None
        return True


def install() -> None:
    """Add the filter to every handler of `LOGGERS` (call after logging is configured)."""
    guard = RedactSecrets()
    for name in LOGGERS:
        for handler in logging.getLogger(name).handlers:
            if not any(isinstance(f, RedactSecrets) for f in handler.filters):
                handler.addFilter(guard)
