"""Error text before it is stored or logged: secrets scrubbed, length capped."""

from __future__ import annotations

import logging
import timeit
from typing import Any

import pytest
from django.conf import settings
from django.test import override_settings

from django_dbqueue import job, signals
from django_dbqueue.errors import SCRUBBED, ScrubFilter, cap, clean, scrub_secrets
from django_dbqueue.models import FailedJob
from tests.conftest import run_worker

# Secrets a failing job's message holds, at its start and at its end.
PASSWORD = "hunter2"
API_KEY = "sk_live_51HxQ9zGaaaBBBcccDDD"
CARD = "4111 1111 1111 1111"
END = "END-OF-MESSAGE"


def secret_message(filler: int) -> str:
    return f"login failed password={PASSWORD} " + "x" * filler + f" api_key={API_KEY} card {CARD} {END}"


@job(tries=1)
def leak_secrets(filler: int) -> None:
    raise ValueError(secret_message(filler))


@job(tries=1)
def announce_password() -> None:
    raise RuntimeError(f"password={PASSWORD}")


def shout(text: str) -> str:
    """A project's own scrubber, named by its dotted path in a test."""
    return text.upper().replace(PASSWORD.upper(), "<gone>")


def broken_scrubber(text: str) -> str:
    raise KeyError(f"cannot scrub {text}")


def dbqueue(**overrides: Any) -> override_settings:
    return override_settings(DBQUEUE={**settings.DBQUEUE, **overrides})


def assert_no_secret(text: str) -> None:
    assert PASSWORD not in text and API_KEY not in text and CARD not in text


# Unit: scrub_secrets, one pattern at a time.


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("password=hunter2 next", f"password={SCRUBBED} next"),
        ("passwd=a pwd=b secret=c token=d", f"passwd={SCRUBBED} pwd={SCRUBBED} secret={SCRUBBED} token={SCRUBBED}"),
        ("api_key=a apikey=b access_key=c", f"api_key={SCRUBBED} apikey={SCRUBBED} access_key={SCRUBBED}"),
        ("private_key=a auth=b credentials=c", f"private_key={SCRUBBED} auth={SCRUBBED} credentials={SCRUBBED}"),
        ("db_password: hunter2, user: bob", f"db_password: {SCRUBBED}, user: bob"),
        ('{"api_key": "abc123", "name": "x"}', f'{{"api_key": "{SCRUBBED}", "name": "x"}}'),
        ("{'client_secret': 'it\\'s', 'n': 1}", f"{{'client_secret': '{SCRUBBED}', 'n': 1}}"),
        ("{'password': 12345}", f"{{'password': {SCRUBBED}}}"),
        ("connect(password = 'hunter2')", f"connect(password = '{SCRUBBED}')"),
        ("auth=('bob', 'hunter2') sent", f"auth=({SCRUBBED}) sent"),
        ("X-Api-Key: k-123", f"X-Api-Key: {SCRUBBED}"),
        ("apiKey=a accessToken=b", f"apiKey={SCRUBBED} accessToken={SCRUBBED}"),
        (
            "GET https://api.example.com/v1?user=bob&access_token=abc.def&page=2#top",
            f"GET https://api.example.com/v1?user=bob&access_token={SCRUBBED}&page=2#top",
        ),
        ("Authorization: Bearer eyJhbGciOiJIUzI1NiJ9.e30", f"Authorization: Bearer {SCRUBBED}"),
        ("authorization: Basic Ym9iOmh1bnRlcjI=", f"authorization: Basic {SCRUBBED}"),
        ("{'Authorization': 'Bearer abc'}", f"{{'Authorization': '{SCRUBBED}'}}"),
        ("sent Bearer eyJhbGciOiJIUzI1NiJ9 upstream", f"sent Bearer {SCRUBBED} upstream"),
        ("postgres://bob:hunter2@db:5432/app", f"postgres://bob:{SCRUBBED}@db:5432/app"),
        ("redis://:p@ss:w0rd@cache/0", f"redis://:{SCRUBBED}@cache/0"),
        ("card 4111 1111 1111 1111 declined", f"card {SCRUBBED} declined"),
        ("card 4111-1111-1111-1111.", f"card {SCRUBBED}."),
        ("card=4111111111111111", f"card={SCRUBBED}"),
        ("amex 3782 822463 10005", f"amex {SCRUBBED}"),
    ],
)
def test_scrub_secrets_replaces_each_kind_of_secret(text, expected):
    assert scrub_secrets(text) == expected


@pytest.mark.parametrize(
    "text",
    [
        "order 4111111111111112 not found",  # 16 digits that fail the Luhn check
        "the token expired, ask for a new token",
        "the password was rejected: try again later",  # prose, not password:
        "author=Bob tokens=3 password_hint=pet keyboard=us",
        "password:\n  next line",
        "Bearer of bad news",
        "https://example.com/path?page=2 and mailto:bob@example.com",
        "ratio 0.4111111111111111, at 2026-01-01 12:00",
        "ValueError: invalid literal for int() with base 10: 'abc'",
        '  File "/srv/app/.venv/lib/python3.13/site-packages/django/db/utils.py", line 105, in inner',
        "",
    ],
)
def test_scrub_secrets_keeps_text_that_holds_no_secret(text):
    assert scrub_secrets(text) == text


# Unit: cap.


def test_cap_keeps_text_within_the_limit_whole():
    assert cap("a" * 200, 200) == "a" * 200
    assert cap("a" * 10**6, None) == "a" * 10**6


def test_cap_keeps_the_head_and_the_tail_around_a_marker_that_counts_what_was_cut():
    text = "H" * 5000 + "x" * 100_000 + "T" * 5000
    capped = cap(text, 1000)
    head, marker, tail = capped.split("\n")
    assert len(capped) <= 1000 and len(capped) >= 995
    assert set(head) == {"H"} and set(tail) == {"T"}
    cut = len(text) - len(head) - len(tail)
    assert marker == f"[... {cut:,} characters cut ...]"
    assert text.startswith(head) and text.endswith(tail)


# Integration: what the worker stores.


@pytest.mark.django_db
def test_a_failed_job_stores_neither_secret_and_keeps_the_head_and_tail_of_a_1_mb_message():
    leak_secrets.enqueue(1_000_000)
    run_worker()
    error = FailedJob.objects.get().error
    assert_no_secret(error)
    assert len(error) <= 20000 and "characters cut ..." in error
    assert error.startswith("Traceback (most recent call last):\n")
    assert f"ValueError: login failed password={SCRUBBED} x" in error
    assert error.endswith(f"api_key={SCRUBBED} card {SCRUBBED} {END}\n")
    assert FailedJob.objects.get().exception_class == "builtins.ValueError"


@pytest.mark.django_db
def test_error_text_within_the_limit_is_scrubbed_and_stored_whole():
    leak_secrets.enqueue(10)
    run_worker()
    error = FailedJob.objects.get().error
    assert_no_secret(error)
    message = f"login failed password={SCRUBBED} {'x' * 10} api_key={SCRUBBED} card {SCRUBBED} {END}"
    assert error.endswith(f"ValueError: {message}\n")


@pytest.mark.django_db
@dbqueue(ERROR_MAX_LENGTH=500)
def test_error_max_length_sets_the_cap():
    leak_secrets.enqueue(5000)
    run_worker()
    error = FailedJob.objects.get().error
    assert len(error) <= 500 and error.endswith(f"{END}\n") and error.startswith("Traceback")


@pytest.mark.django_db
@dbqueue(ERROR_MAX_LENGTH=None)
def test_no_error_max_length_stores_the_whole_text():
    leak_secrets.enqueue(100_000)
    run_worker()
    error = FailedJob.objects.get().error
    assert "x" * 100_000 in error and "characters cut" not in error
    assert_no_secret(error)


@pytest.mark.django_db
@dbqueue(ERROR_SCRUBBER=None)
def test_no_error_scrubber_stores_the_text_as_is():
    leak_secrets.enqueue(10)
    run_worker()
    assert secret_message(10) in FailedJob.objects.get().error


@pytest.mark.django_db
@pytest.mark.parametrize("scrubber", [shout, "tests.test_errors.shout"])
def test_a_project_scrubber_given_as_a_callable_or_a_dotted_path_is_used(scrubber):
    with dbqueue(ERROR_SCRUBBER=scrubber):
        announce_password.enqueue()
        run_worker()
    assert FailedJob.objects.get().error.endswith("RUNTIMEERROR: PASSWORD=<gone>\n")


def test_the_scrubber_follows_the_setting_when_it_changes():
    with dbqueue(ERROR_SCRUBBER=shout):
        assert clean("password=hunter2") == "PASSWORD=<gone>"
    with dbqueue(ERROR_SCRUBBER=str.title):
        assert clean("password=hunter2") == "Password=Hunter2"
    assert clean("password=hunter2") == f"password={SCRUBBED}"


@pytest.mark.django_db
@pytest.mark.parametrize("scrubber", [broken_scrubber, "tests.test_errors.no_such_scrubber"])
def test_a_scrubber_that_fails_stores_a_placeholder_never_the_text(scrubber, caplog):
    with dbqueue(ERROR_SCRUBBER=scrubber), caplog.at_level(logging.ERROR, logger="django_dbqueue"):
        announce_password.enqueue()
        run_worker()
    error = FailedJob.objects.get().error
    raised = "KeyError" if scrubber is broken_scrubber else "ImportError"
    name = "tests.test_errors.broken_scrubber" if scrubber is broken_scrubber else scrubber
    assert error == f"[error text withheld: the scrubber {name} raised {raised}]"
    failures = [r for r in caplog.records if "error scrubber failed" in r.getMessage()]
    assert failures and f"exception={raised}" in failures[0].getMessage()
    assert PASSWORD not in caplog.text


def test_a_scrubber_that_returns_no_str_counts_as_failed():
    with dbqueue(ERROR_SCRUBBER=lambda text: None):
        assert clean("password=hunter2").startswith("[error text withheld: the scrubber ")


# The worker's log lines.


def test_a_warning_logged_by_the_queue_is_scrubbed(caplog):
    with caplog.at_level(logging.WARNING, logger="django_dbqueue"):
        logging.getLogger("django_dbqueue").warning("cannot connect url=%s", "postgres://bob:hunter2@db/app")
    assert caplog.records[-1].getMessage() == f"cannot connect url=postgres://bob:{SCRUBBED}@db/app"
    assert PASSWORD not in caplog.text


@pytest.mark.django_db
def test_a_traceback_logged_by_the_worker_is_scrubbed(caplog):
    def broken(**kwargs: Any) -> None:
        raise RuntimeError(f"receiver saw password={PASSWORD}")

    signals.job_failed.connect(broken, weak=False)
    try:
        with caplog.at_level(logging.ERROR, logger="django_dbqueue"):
            announce_password.enqueue()
            run_worker()
    finally:
        signals.job_failed.disconnect(broken)
    logged = next(r for r in caplog.records if "raised" in r.getMessage())
    assert logged.exc_text and f"RuntimeError: receiver saw password={SCRUBBED}" in logged.exc_text
    # Django's dispatcher logs the receiver's failure too, on its own logger: not the queue's to scrub.
    ours = [r for r in caplog.records if r.name == "django_dbqueue"]
    assert not any(PASSWORD in (r.getMessage() + (r.exc_text or "")) for r in ours)


def test_info_records_pass_the_filter_untouched():
    record = logging.LogRecord("django_dbqueue", logging.INFO, __file__, 1, "job=%s note=%s", ("a", "password=x"), None)
    assert ScrubFilter().filter(record) and record.args == ("a", "password=x")


def test_the_filter_costs_info_records_next_to_nothing():
    """The per-job INFO line goes through the filter: it must stay negligible."""
    record = logging.LogRecord("django_dbqueue", logging.INFO, __file__, 1, "job=%s id=%s", ("a", 1), None)
    scrub_filter = ScrubFilter()
    seconds = min(timeit.repeat(lambda: scrub_filter.filter(record), number=10_000, repeat=5)) / 10_000
    assert seconds < 2e-6
