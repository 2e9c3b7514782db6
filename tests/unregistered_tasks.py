"""A task module that nothing imports: a result row that names its task must not import it
(tests/test_tasks.py), since importing a module runs its code."""

from django.tasks import task


@task
def never_imported() -> None:
    """Never runs."""
