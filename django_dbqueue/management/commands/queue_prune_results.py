from django_dbqueue import handles
from django_dbqueue.management.base import PruneCommand


class Command(PruneCommand):
    help = "Delete the kept results of jobs and django.tasks tasks that finished more than N hours ago."
    hours_help = "Delete results finished longer ago than this many hours (required)."
    done = "Deleted {count} result(s) finished more than {hours:g} h ago."
    prune = staticmethod(handles.prune_results)
