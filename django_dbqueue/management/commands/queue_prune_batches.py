from django_dbqueue import batches
from django_dbqueue.management.base import PruneCommand


class Command(PruneCommand):
    help = (
        "Delete the batches that finished more than N hours ago, e.g. daily from cron. "
        "Their failed members stay in the failed jobs (retried, they run outside any batch)."
    )
    hours_help = "Delete batches finished more than N hours ago, N > 0 (required, no default)."
    done = "Deleted {count} batch(es) finished more than {hours:g} h ago."
    prune = staticmethod(batches.prune)
