"""The demo's jobs, one per feature of the queue.

django_dbqueue imports every installed app's ``jobs.py`` at startup, so a
worker knows these jobs by their names (``demo.jobs.send_welcome_email``, ...).
"""

import logging
import os
import time

from django.utils import timezone

from django_dbqueue import Batch, Chain, JobContext, batch, chain, job

from .models import Order

logger = logging.getLogger("demo")


@job
def send_welcome_email(user_email: str) -> None:
    """Send a welcome email (here: log one line); succeeds on its first attempt.

    A plain ``@job`` takes its options from the worker and ``DBQUEUE``.
    """
    logger.info("welcome email sent to=%s", user_email)


@job(takes_context=True, tries=3, backoff=0)
def sync_customer_to_crm(context: JobContext, user_email: str) -> None:
    """Push a customer to a flaky CRM: the first attempt fails, the retry succeeds.

    ``takes_context=True`` passes a JobContext first, with the attempt number.
    A job that raises is released and runs again until it has used its tries.
    ``backoff=0`` makes the retry available at once so the demo's
    ``--stop-when-empty`` worker sees it; a real job would wait, e.g.
    ``backoff=[10, 60, 300]``.
    """
    if context.attempt == 1:
        raise ConnectionError(f"CRM did not answer for {user_email} (attempt {context.attempt} of {context.tries})")
    logger.info("customer synced to CRM email=%s attempt=%s", user_email, context.attempt)


@job(tries=2, backoff=0)
def notify_warehouse(order_number: str) -> None:
    """Tell a warehouse that does not exist: fails every time.

    After ``tries=2`` attempts the job moves to FailedJob, with the full
    traceback in ``error`` and its payload kept, so it can be retried later.
    """
    raise RuntimeError(f"warehouse API rejected order {order_number}: 503 Service Unavailable")


@job(timeout=10, retry_after=30)
def build_sales_report(seconds: float = 3) -> str:
    """Take a few seconds, like a real report.

    ``timeout=10``: a run that takes longer is stopped and counts as a failed attempt.
    ``retry_after=30``: a reservation older than that is presumed dead (its worker
    was killed) and the job is reclaimed. It must be longer than the timeout, or a
    job still running would be reclaimed and run a second time in parallel.
    """
    time.sleep(seconds)
    logger.info("sales report built seconds=%s", seconds)
    return "report.pdf"


@job
def confirm_order(order: Order) -> None:
    """Confirm an order given as a model instance.

    The payload stores a reference (``demo.order`` and the primary key), not the
    row, and the worker fetches the row again when the job runs, so the job sees
    the order as it is then. Enqueued in the transaction that creates the order,
    the job exists if and only if the order commits.
    """
    order.status = Order.Status.CONFIRMED
    order.confirmed_at = timezone.now()
    order.save(update_fields=["status", "confirmed_at"])
    logger.info("order confirmed number=%s", order.number)


@job(tries=1)
def notify_shipping(order_number: str) -> None:
    """Tell the shipping service about an order; fails while ``SHIPPING_API_DOWN`` is set.

    The tutorial (docs/tutorial.md) runs it with the variable set, so the job fails for
    good (``tries=1``) and lands in FailedJob; then, the "outage" over, it retries it.
    """
    if os.environ.get("SHIPPING_API_DOWN"):
        raise ConnectionError(f"shipping API unreachable for order {order_number}")
    logger.info("shipping notified order=%s", order_number)


# -- A long chain with progress: "render a video" ---------------------------------
#
# Four steps that run one after another (``chain(...)``), each taking about
# STEP_SECONDS and reporting its progress TICKS times. A step reports its own
# percent (0-100); the queue scales it to the whole chain (step 2 at 50% is 37.5%
# of a 4-step chain) and stores it under ``pipeline.progress_key``, which the page
# at / polls through django_dbqueue's JSON view.

STEP_SECONDS = 1.6
TICKS = 8


def _work(context: JobContext, doing: str, seconds: float) -> None:
    """Pretend to work for ``seconds``, reporting e.g. "encoding 40%" as it goes."""
    for tick in range(TICKS):
        percent = tick * 100 // TICKS
        context.progress(percent, f"{doing} {percent}% (step {context.chain_step} of {context.chain_steps})")
        time.sleep(seconds / TICKS)
    # When the step returns, the queue stores it as done ("step 2 of 4 done", or
    # "finished" with 100% after the last step).


@job(takes_context=True, timeout=30)
def fetch_footage(context: JobContext, title: str, seconds: float = STEP_SECONDS) -> None:
    _work(context, "fetching footage", seconds)
    logger.info("footage fetched title=%s", title)


@job(takes_context=True, timeout=30)
def encode_video(context: JobContext, title: str, seconds: float = STEP_SECONDS) -> None:
    _work(context, "encoding", seconds)
    logger.info("video encoded title=%s", title)


@job(takes_context=True, timeout=30)
def burn_subtitles(context: JobContext, title: str, seconds: float = STEP_SECONDS) -> None:
    _work(context, "burning subtitles", seconds)
    logger.info("subtitles burnt title=%s", title)


@job(takes_context=True, timeout=30)
def publish_video(context: JobContext, title: str, seconds: float = STEP_SECONDS) -> None:
    _work(context, "uploading", seconds)
    logger.info("video published title=%s", title)


def render_video(title: str, seconds: float = STEP_SECONDS) -> Chain:
    """The chain of steps that renders one video; call ``.enqueue()`` on it."""
    return chain(*(step.bind(title, seconds) for step in (fetch_footage, encode_video, burn_subtitles, publish_video)))


# -- A batch with progress: "process 40 images" -------------------------------------
#
# Forty jobs that run in parallel as one unit (``batch(...)``), one per image, each
# taking about IMAGE_SECONDS. The batch's progress is read from its counters (how
# many members ended, succeeded, failed), under ``handle.progress_key``
# (``batch:<id>``), through the same JSON view as the chain's. Two images are
# broken: their jobs fail for good, the batch counts them as failed and still
# finishes; ``on_finish`` runs once, when the last member ended.

IMAGES = 40
IMAGE_SECONDS = 0.1
BROKEN_IMAGES = frozenset({13, 29})


@job(tries=1, timeout=30)
def process_image(album: str, number: int, seconds: float = IMAGE_SECONDS) -> None:
    """Make a thumbnail of one image; a broken one fails for good (``tries=1``) and counts as a failed member."""
    time.sleep(seconds)
    if number in BROKEN_IMAGES:
        raise ValueError(f"image {number} of {album!r} is not a JPEG: cannot decode it")
    logger.info("image processed album=%s number=%s", album, number)


@job(takes_context=True)
def album_processed(context: JobContext, album: str) -> None:
    """The batch's ``on_finish`` callback: runs once, after every image ended, whichever way.

    ``context.batch`` is the batch (read now), with its final counts.
    """
    album_batch = context.batch
    if album_batch is None:
        logger.warning("album processed album=%s outside a batch", album)
        return
    logger.info(
        "album processed album=%s batch=%s total=%s succeeded=%s failed=%s",
        album,
        album_batch.id,
        album_batch.total,
        album_batch.succeeded,
        album_batch.failed,
    )


def process_album(album: str, images: int = IMAGES, seconds: float = IMAGE_SECONDS) -> Batch:
    """The batch that processes ``images`` images of ``album``; call ``.enqueue()`` on it."""
    members = (process_image.bind(album, number, seconds) for number in range(1, images + 1))
    return batch(*members, name=f"album {album}"[:200]).on_finish(album_processed.bind(album))
