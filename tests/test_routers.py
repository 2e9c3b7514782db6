"""A project whose router sends reads to a replica (issue 16, point 9).

``replica`` is a second alias of the same database (tests/settings.py); with
``tests.routers.ReadReplicaRouter`` every ORM read of the project goes there. The
claim and every state change of a job must still go to the queue's database
(``DBQUEUE["DATABASE"]``): a claim read from a replica could hand out a job
another worker holds. Counts for operators read the replica only when
``DBQUEUE["READ_DATABASE"]`` names it.
"""

from __future__ import annotations

import django
import pytest
from django.db import connections
from django.test import override_settings
from django.test.utils import CaptureQueriesContext

from django_dbqueue import chain, enqueue_many, operations
from django_dbqueue.models import FailedJob, Job
from tests.conftest import run_worker
from tests.testapp import jobs

pytestmark = [
    pytest.mark.django_db(transaction=True, databases=["default", "replica"]),
]

ROUTED = override_settings(DATABASE_ROUTERS=["tests.routers.ReadReplicaRouter"])


def test_the_router_really_sends_reads_to_the_replica():
    from tests.testapp.models import Run

    with ROUTED, CaptureQueriesContext(connections["replica"]) as replica:
        Run.objects.exists()
    assert len(replica.captured_queries) == 1


def test_with_reads_routed_to_a_replica_claims_and_state_changes_stay_on_the_queue_database():
    with ROUTED, CaptureQueriesContext(connections["replica"]) as replica:
        jobs.add.enqueue(1, 2)
        enqueue_many([jobs.add.bind(i, i) for i in range(5)])
        chain(jobs.add.bind(1, 1), jobs.add.bind(2, 2)).enqueue()
        jobs.always_fail.enqueue("routed")
        run_worker()
        assert FailedJob.objects.count() == 1
        assert operations.retry_failed(FailedJob.objects.all()) == 1
        run_worker()
        operations.queue_overview()
        assert not Job.objects.exists()
        if django.VERSION >= (6, 0):
            from django.tasks import default_task_backend

            from tests.testapp.tasks import add_numbers

            result = add_numbers.enqueue(2, 3)
            run_worker()
            assert default_task_backend.get_result(result.id).return_value == 5
    assert replica.captured_queries == [], [query["sql"] for query in replica.captured_queries]


def test_operator_counts_read_the_replica_only_when_read_database_names_it():
    jobs.add.enqueue(1, 2)
    with ROUTED, CaptureQueriesContext(connections["replica"]) as replica:
        stats = operations.queue_overview()
    assert replica.captured_queries == [] and stats[0].waiting == 1
    with (
        ROUTED,
        override_settings(DBQUEUE={"READ_DATABASE": "replica"}),
        CaptureQueriesContext(connections["replica"]) as replica,
        CaptureQueriesContext(connections["default"]) as primary,
    ):
        stats = operations.queue_overview()
    assert stats[0].waiting == 1
    assert replica.captured_queries and not primary.captured_queries
