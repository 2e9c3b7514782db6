"""The progress JSON view: who may read a key's progress, and what it serves."""

from __future__ import annotations

import time

import pytest
from django.contrib.auth.models import Permission, User
from django.core import signing
from django.db.models.functions import Now
from django.test import Client, override_settings
from django.urls import reverse

from django_dbqueue import progress_token
from django_dbqueue.models import JobProgress

pytestmark = pytest.mark.django_db

TRACEBACK = "Traceback (most recent call last):\n  File 'jobs.py', line 3\nValueError: card 4242 declined\n"


@pytest.fixture
def stored() -> JobProgress:
    """Progress of job 17, failed, next to the progress of another job."""
    JobProgress.objects.create(key="18", percent=10, stage="someone else's", updated_at=Now())
    return JobProgress.objects.create(
        key="17", percent=40, stage="charging", failed=True, error=TRACEBACK, updated_at=Now()
    )


def url(key: str, token: str | None = None) -> str:
    path = reverse("django_dbqueue:progress", kwargs={"key": key})
    return path if token is None else f"{path}?token={token}"


def user_client(*codenames: str) -> Client:
    user = User.objects.create_user(f"user{User.objects.count()}", password="pw")
    user.user_permissions.set(
        Permission.objects.filter(content_type__app_label="django_dbqueue", codename__in=codenames)
    )
    client = Client()
    client.force_login(user)
    return client


def old_token(key: str, seconds: float, monkeypatch: pytest.MonkeyPatch) -> str:
    """A token for ``key`` made ``seconds`` ago."""
    made_at = time.time() - seconds
    with monkeypatch.context() as patch:
        patch.setattr(signing.time, "time", lambda: made_at)
        return str(progress_token(key))


def test_an_anonymous_client_gets_401_and_no_progress(stored):
    response = Client().get(url("17"))
    assert response.status_code == 401 and response["Cache-Control"] == "no-store"
    assert "charging" not in response.content.decode() and "percent" not in response.json()


def test_a_user_without_the_view_permission_gets_403(stored):
    response = user_client("view_job", "view_failedjob").get(url("17"))
    assert response.status_code == 403 and response["Cache-Control"] == "no-store"
    assert "django_dbqueue.view_jobprogress" in response.json()["detail"]
    assert "charging" not in response.content.decode()


def test_a_user_with_the_view_permission_reads_any_key(stored):
    client = user_client("view_jobprogress")
    response = client.get(url("17"))
    assert response.status_code == 200 and response["Cache-Control"] == "no-store"
    data = response.json()
    assert (data["key"], data["percent"], data["stage"], data["failed"]) == ("17", 40, "charging", True)
    assert client.get(url("18")).json()["stage"] == "someone else's"


def test_a_refused_client_cannot_tell_whether_a_key_exists(stored):
    assert Client().get(url("17")).status_code == Client().get(url("999")).status_code == 401
    other = user_client()
    assert other.get(url("17")).status_code == other.get(url("999")).status_code == 403
    assert Client().get(url("999", progress_token("17"))).status_code == 403


def test_an_unknown_key_is_404_to_whoever_may_see_it(stored):
    response = user_client("view_jobprogress").get(url("999"))
    assert response.status_code == 404 and response["Cache-Control"] == "no-store"
    # A token made at enqueue time works before the first progress is written: 404, then 200.
    assert Client().get(url("chain:new", progress_token("chain:new"))).status_code == 404


def test_a_valid_token_serves_its_key_to_an_anonymous_client(stored):
    response = Client().get(url("17", progress_token(17)))
    assert response.status_code == 200 and response["Cache-Control"] == "no-store"
    assert (response.json()["key"], response.json()["stage"]) == ("17", "charging")


def test_a_token_of_another_key_is_refused(stored):
    response = Client().get(url("18", progress_token("17")))
    assert response.status_code == 403 and "another key" in response.json()["detail"]
    assert "someone else's" not in response.content.decode()


def test_a_tampered_token_is_refused(stored):
    value_17 = str(progress_token("17")).split(":", 1)[0]
    stamp_and_signature_18 = str(progress_token("18")).split(":", 1)[1]
    forged = f"{value_17}:{stamp_and_signature_18}"  # key 17 with the signature made for key 18
    token = str(progress_token("17"))
    flipped = token[:-1] + ("A" if token[-1] != "A" else "B")
    for bad in (forged, flipped, "garbage"):
        response = Client().get(url("17", bad))
        assert response.status_code == 403 and response.json()["detail"] == "the progress token is not valid", bad
    # The same key signed for another purpose (another salt) is no progress token either.
    assert Client().get(url("17", signing.dumps("17"))).status_code == 403


def test_an_expired_token_is_refused_and_its_age_limit_is_a_setting(stored, monkeypatch):
    token = old_token("17", 120, monkeypatch)
    assert Client().get(url("17", token)).status_code == 200  # default: 3600 s
    with override_settings(DBQUEUE={"PROGRESS_TOKEN_MAX_AGE": 60}):
        response = Client().get(url("17", token))
    assert response.status_code == 403 and response.json()["detail"] == "the progress token has expired"
    assert Client().get(url("17", old_token("17", 3600 - 60, monkeypatch))).status_code == 200
    assert Client().get(url("17", old_token("17", 3600 + 60, monkeypatch))).status_code == 403


def test_the_error_text_is_hidden_by_default(stored):
    for client, token in ((user_client("view_jobprogress"), None), (Client(), progress_token("17"))):
        data = client.get(url("17", token)).json()
        assert data["failed"] is True and data["error"] == ""
        assert "4242" not in client.get(url("17", token)).content.decode()


@override_settings(DBQUEUE={"PROGRESS_SHOW_ERROR": True})
def test_the_setting_shows_only_the_errors_last_line(stored):
    data = Client().get(url("17", progress_token("17"))).json()
    assert data["error"] == "ValueError: card 4242 declined"


def test_the_view_answers_only_get(stored):
    client = user_client("view_jobprogress")
    assert client.post(url("17")).status_code == 405


@pytest.mark.parametrize(
    "key",
    [
        "batch:²",  # a digit to str.isdigit, not to int()
        "batch:١٢",  # Arabic-Indic digits: int() reads them, but no batch is named so
        "batch:" + "9" * 30,  # past every integer column
        "batch:-1",
        "batch:",
        "17\x00",  # PostgreSQL refuses NUL in a text value
        "k" * 300,  # longer than the key column
    ],
)
def test_a_key_that_names_nothing_is_404_not_a_server_error(stored, key):
    response = user_client("view_jobprogress").get(url(key))
    assert response.status_code == 404 and response.json()["detail"] == "no progress is stored under this key"


def test_a_token_in_the_authorization_header_serves_its_key_and_no_other(stored):
    header = {"HTTP_AUTHORIZATION": f"Bearer {progress_token('17')}"}
    response = Client().get(url("17"), **header)
    assert response.status_code == 200 and response.json()["stage"] == "charging"
    assert Client().get(url("18"), **header).status_code == 403
    forged = {"HTTP_AUTHORIZATION": "Bearer garbage"}
    assert Client().get(url("17"), **forged).json()["detail"] == "the progress token is not valid"
    # The header wins over the query string, which access logs keep.
    assert Client().get(url("18", progress_token("18")), **header).status_code == 403
