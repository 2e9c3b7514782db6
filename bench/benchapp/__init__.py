"""The bench app: no-op jobs and a job that records when it started."""
