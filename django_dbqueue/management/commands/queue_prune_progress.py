from django_dbqueue import progress
from django_dbqueue.management.base import PruneCommand


class Command(PruneCommand):
    help = "Delete progress rows (of jobs and chains) not updated for N hours."
    hours_help = "Delete rows older than this many hours (required)."
    done = "Deleted {count} progress row(s) older than {hours:g} h."
    prune = staticmethod(progress.prune)
