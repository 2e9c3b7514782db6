from django_dbqueue import operations
from django_dbqueue.management.base import PruneCommand


class Command(PruneCommand):
    help = "Delete the failed jobs that failed more than --hours ago, e.g. daily from cron."
    hours_help = "Delete failed jobs older than N hours, N > 0 (required, no default)."
    done = "{count} failed job(s) older than {hours:g} hours were deleted."
    prune = staticmethod(operations.prune_failed)
