"""Error text before it is stored or logged: secrets scrubbed, length capped."""

from __future__ import annotations

import logging
import re
import traceback
from collections.abc import Callable

from django.utils.module_loading import import_string

from . import conf

logger = logging.getLogger("django_dbqueue")

# What a scrubbed value becomes.
SCRUBBED = "[scrubbed]"

# Set on log records already cleaned, or that must not be (the scrubber's own failure).
SCRUBBED_ATTRIBUTE = "dbqueue_scrubbed"

# Names whose values are secrets, also as the end of a longer name: db_password,
# client_secret, access_token, X-Api-Key, apiKey.
_SECRET_NAMES = (
    r"password|passwd|pwd|secret|token|api[_-]?key|access[_-]?key|private[_-]?key|authorization|auth|credentials"
)

# One of these is in every secret name, lower-cased.
_NAME_WORDS = ("pass", "pwd", "secret", "token", "key", "auth", "credentials")

# ``name=value``, ``name: value``, ``"name": "value"`` and ``?name=value&``. The separator must
# follow the name at once ("author", "tokens" and prose are left alone) and stays on one line; a
# bare value ends at a space, quote, separator or closing bracket; a scheme word (Bearer) is kept.
_NAMED_VALUE = re.compile(
    r"(?P<name>(?:" + _SECRET_NAMES + r")[\"']?)"
    r"(?P<sep>[ \t]*[:=][ \t]*)"
    r"(?P<scheme>(?:bearer|basic|token|digest)[ \t]+)?"
    r"(?P<value>\"(?:[^\"\\\n]|\\.)*\"|'(?:[^'\\\n]|\\.)*'|\([^()\n]{0,200}\)|[^\s\"'&,;<>)\]}]+)",
    re.IGNORECASE,
)

# A bearer token on its own; eight characters at least, so prose ("Bearer of bad news") is kept.
_BEARER = re.compile(r"\b(?P<scheme>Bearer[ \t]+)[A-Za-z0-9\-._~+/]{8,}=*")

# ``scheme://user:password@host``: the password, which may hold "@", goes; the user stays.
_URL_PASSWORD = re.compile(r"(?P<head>\b[a-z][a-z0-9+.-]{0,30}://[^\s:/@?#]*:)[^\s/?#]+@", re.IGNORECASE)

# 13 to 19 digits, whole or grouped as on cards (4-4-4-4, 4-6-5, 4-4-4-4-3), not part of a longer
# number, word or decimal; kept unless they pass the Luhn check.
_CARD_CANDIDATE = re.compile(r"(?<![\w.-])(?:\d{13,19}|\d{4}(?P<s>[ -])\d{4,6}(?:(?P=s)\d{3,5}){1,3})(?![\w-]|\.\d)")


def _luhn(digits: str) -> bool:
    doubled = sum(sum(divmod(2 * int(char), 10)) for char in digits[-2::-2])
    return (sum(int(char) for char in digits[-1::-2]) + doubled) % 10 == 0


def _named_value(match: re.Match[str]) -> str:
    value = match.group("value")
    replaced = f"{value[0]}{SCRUBBED}{value[-1]}" if value[0] in "\"'(" else SCRUBBED
    return f"{match.group('name')}{match.group('sep')}{match.group('scheme') or ''}{replaced}"


def _card(match: re.Match[str]) -> str:
    digits = re.sub(r"\D", "", match.group(0))
    return SCRUBBED if 13 <= len(digits) <= 19 and _luhn(digits) else match.group(0)


def scrub_secrets(text: str) -> str:
    """Return ``text`` with passwords, keys, tokens, URL passwords and card numbers replaced by ``[scrubbed]``."""
    # Plain substring tests skip the slower patterns on text that cannot match them.
    if "://" in text:
        text = _URL_PASSWORD.sub(lambda m: f"{m.group('head')}{SCRUBBED}@", text)
    lowered = text.lower()
    if any(word in lowered for word in _NAME_WORDS):
        text = _NAMED_VALUE.sub(_named_value, text)
    if "Bearer" in text:
        text = _BEARER.sub(lambda m: f"{m.group('scheme')}{SCRUBBED}", text)
    return _CARD_CANDIDATE.sub(_card, text)


def _cut_marker(count: int) -> str:
    return f"\n[... {count:,} characters cut ...]\n"


def cap(text: str, limit: int | None) -> str:
    """Return ``text`` cut to at most ``limit`` characters, keeping its head and tail around a marker."""
    if limit is None or len(text) <= limit:
        return text
    # The marker for the whole length is the longest the final one can be.
    kept = limit - len(_cut_marker(len(text)))
    if kept <= 0:
        return text[:limit]
    head = kept // 2
    return f"{text[:head]}{_cut_marker(len(text) - kept)}{text[len(text) - (kept - head) :]}"


# The ERROR_SCRUBBER value last resolved, and what it resolved to: resolved again when the setting changes.
_resolved: tuple[object, Callable[[str], str]] | None = None


def scrubber() -> Callable[[str], str] | None:
    """Return the ``ERROR_SCRUBBER`` callable, imported once per setting value; None when disabled."""
    global _resolved
    value = conf.get("ERROR_SCRUBBER")
    if value is None:
        return None
    resolved = _resolved
    if resolved is None or resolved[0] is not value:
        resolved = _resolved = (value, import_string(value) if isinstance(value, str) else value)
    return resolved[1]


def scrub(text: str) -> str:
    """Return ``text`` through the ``ERROR_SCRUBBER``; a placeholder, never the text, if it fails."""
    try:
        func = scrubber()
        if func is None:
            return text
        scrubbed = func(text)
        if not isinstance(scrubbed, str):
            raise TypeError(f"returned {type(scrubbed).__name__}, not str")
        return scrubbed
    except Exception as exc:  # noqa: BLE001 - a broken scrubber must not let the text through, nor end the worker
        return _withheld(exc)


def _withheld(exc: Exception) -> str:
    """Log a scrubber's failure and return the placeholder stored instead of the text; neither
    names the exception's message nor carries its traceback, which may quote the text."""
    setting = conf.get("ERROR_SCRUBBER")
    if isinstance(setting, str):
        name = setting
    else:
        name = f"{getattr(setting, '__module__', '?')}.{getattr(setting, '__qualname__', type(setting).__qualname__)}"
    frames = traceback.extract_tb(exc.__traceback__)
    where = f" at {frames[-1].filename}:{frames[-1].lineno}" if frames else ""
    logger.error(
        "error scrubber failed scrubber=%s exception=%s%s: the error text is withheld",
        name,
        type(exc).__name__,
        where,
        extra={SCRUBBED_ATTRIBUTE: True},
    )
    return f"[error text withheld: the scrubber {name} raised {type(exc).__name__}]"


def clean(text: str) -> str:
    """Return ``text`` as it may be stored or logged: scrubbed, then capped to ``ERROR_MAX_LENGTH``."""
    return cap(scrub(text), conf.get("ERROR_MAX_LENGTH"))


class ScrubFilter(logging.Filter):
    """Clean the message and exception text of records at WARNING and above, or with a traceback;
    routine records (the per-job INFO line) pass at the cost of one comparison."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno < logging.WARNING and not record.exc_info:
            return True
        if getattr(record, SCRUBBED_ATTRIBUTE, False):
            return True
        try:
            message = record.getMessage()
        except Exception:  # noqa: BLE001 - a malformed call is the handler's to report
            return True
        record.msg, record.args = clean(message), None
        if record.exc_info and not record.exc_text:
            # Formatters print exc_text when set; exc_info stays for error trackers (they scrub on their own).
            record.exc_text = clean(logging.Formatter().formatException(record.exc_info))
        setattr(record, SCRUBBED_ATTRIBUTE, True)
        return True


def install_log_filter() -> None:
    """Add the ``ScrubFilter`` to the ``django_dbqueue`` logger, once."""
    target = logging.getLogger("django_dbqueue")
    if not any(isinstance(existing, ScrubFilter) for existing in target.filters):
        target.addFilter(ScrubFilter())
