from typing import Any

from django.utils import timezone

from django_dbqueue import operations
from django_dbqueue.management.base import QueueCommand
from django_dbqueue.worker import RESTART_CHECK_INTERVAL


class Command(QueueCommand):
    help = (
        "Ask every worker, on every host, to finish its current job and exit, so the process "
        "manager starts it again on new code (run after a deploy)."
    )

    def handle(self, *args: Any, **opts: Any) -> None:
        requested = operations.request_restart()
        self.success(f"Restart requested at {timezone.localtime(requested):%Y-%m-%d %H:%M:%S}.")
        self.stdout.write(
            f"Every worker finishes its current job and exits; workers look for the request\n"
            f"every {RESTART_CHECK_INTERVAL:g} s. Under --concurrency the supervisor exits too. Your process\n"
            f"manager (systemd, supervisord) must start them again, on the new code."
        )
