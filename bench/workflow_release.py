"""What a workflow's release costs the server, and what two other designs would: one session, no
other load, over the 10,000-node fan-out and fan-in of ``bench/workflows.py``.

Each node's job row is deleted and its release called in one transaction, the root alone, then
the 10,000 nodes 50 at a time (a worker's claim), then the sink; the release calls are timed.

- ``v0``: ``dbqueue_release_chunk`` as shipped (node state and edges written per success);
- ``v1``: no edge written: a child is ready when every parent's node reads ``succeeded``;
- ``v2``: neither node nor edge written: a child is ready when no parent's job row is left
  (the node's state would be derived from its job row and ``FailedJob``).

The variants are functions of this script only, made in the bench database; they time the
statements, not a whole design (v2 ignores failures, cancels and ``run_anyway``).

    .venv/bin/python -m bench.workflow_release --rounds 2
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time

import psycopg

from bench import workflows as w

# The variants share their shape: mark the nodes (or not), find a parent still waiting (by its
# node's state, or by its job row), release pending children only.
VARIANT = """
CREATE OR REPLACE FUNCTION {name}(succeeded bigint[]) RETURNS bigint AS $$
DECLARE ready text[];
BEGIN
    {mark}
    WITH kids AS (SELECT DISTINCT child_id FROM dbqueue_workflow_edge WHERE parent_id = ANY(succeeded)),
    waits AS (
        SELECT c.id, c.job_id, (
            SELECT p.id FROM dbqueue_workflow_edge u JOIN dbqueue_workflow_node p ON p.id = u.parent_id
            {waiting} AND u.parent_id <> ALL(succeeded)
            ORDER BY u.parent_id DESC LIMIT 1) AS parent
        FROM kids CROSS JOIN LATERAL (
            SELECT id, job_id FROM dbqueue_workflow_node WHERE id = kids.child_id {pending} LIMIT 1
        ) AS c
    ), released AS (
        UPDATE dbqueue_job SET blocked = false FROM waits
        WHERE dbqueue_job.id = waits.job_id AND waits.parent IS NULL AND dbqueue_job.blocked
        AND dbqueue_job.reserved_at IS NULL RETURNING dbqueue_job.queue)
    SELECT ARRAY(SELECT DISTINCT queue FROM released) INTO ready;
    RETURN 0;
END; $$ LANGUAGE plpgsql;
"""
V1 = VARIANT.format(
    name="v1_release",
    mark="UPDATE dbqueue_workflow_node SET state = 'succeeded', finished_at = statement_timestamp() "
    "WHERE id = ANY(succeeded) AND state = 'pending';",
    waiting="WHERE u.child_id = c.id AND p.state <> 'succeeded'",
    pending="AND state = 'pending'",
)
V2 = VARIANT.format(
    name="v2_release",
    mark="",
    waiting="JOIN dbqueue_job pj ON pj.id = p.job_id WHERE u.child_id = c.id",
    pending="",
)
CALL = {
    "v0": "SELECT racing FROM dbqueue_release_chunk(%s::bigint[], 1000000)",
    "v1": "SELECT v1_release(%s::bigint[])",
    "v2": "SELECT v2_release(%s::bigint[])",
}


def run(variant: str) -> tuple[float, float]:
    w.recreate_database()
    subprocess.run([sys.executable, "-c", w.FILL.format(graph=True, nodes=10000)], env=w.env(), cwd=w.ROOT, check=True)
    with psycopg.connect(f"host=127.0.0.1 user=postgres dbname={w.DBNAME}", autocommit=True) as c:
        c.execute(V1)
        c.execute(V2)
        c.execute("VACUUM ANALYZE")
        c.execute("CHECKPOINT")
        nodes = [r[0] for r in c.execute("SELECT id FROM dbqueue_workflow_node ORDER BY id")]
        root, middle, sink = nodes[0], nodes[1:-1], nodes[-1]
        times = []
        for batch in [[root]] + [middle[i : i + 50] for i in range(0, len(middle), 50)] + [[sink]]:
            with c.transaction():
                c.execute("DELETE FROM dbqueue_job WHERE node_id = ANY(%s)", [batch])
                t = time.perf_counter()
                c.execute(CALL[variant], [batch], prepare=True).fetchall()
                times.append(time.perf_counter() - t)
    return times[0], sum(times[1:-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    for _ in range(args.rounds):
        for variant in CALL:
            root, rest = run(variant)
            print(f"{variant}: the root's release {root * 1000:.1f} ms, 200 claims of 50 after it {rest * 1000:.1f} ms")


if __name__ == "__main__":
    main()
