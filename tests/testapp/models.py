from django.db import models


class Run(models.Model):
    """One row per job execution; the unique key proves a job ran once."""

    key = models.CharField(max_length=100, unique=True)
    note = models.TextField(blank=True, default="")
    pid = models.IntegerField(default=0)


class Attempt(models.Model):
    """One row per attempt, for jobs that may run more than once on purpose."""

    key = models.CharField(max_length=100)
    attempt = models.IntegerField()


class Order(models.Model):
    number = models.CharField(max_length=20)
