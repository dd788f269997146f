"""The pure scheduling decision (keel.cluster.scheduler.schedule) and the reservation ledger.

Each test builds the queue, the running work and the clusters' views by hand and checks the
decision: gangs are never split and capacity never summed across clusters, region and device
constraints reject with a reason, the queue is served in priority then submission order, a job
goes where it fits most tightly, only production work preempts (the newest batch jobs, on the
cluster where the fewest must stop, which is then held), and capacity already being given back
is counted so nothing is preempted twice.
"""

from keel.cluster.ledger import CapacityLedger
from keel.cluster.scheduler import ClusterView, PendingJob, RunningJob, schedule
from keel.cluster.spec import Priority

BATCH, INTERACTIVE, PRODUCTION = Priority.BATCH, Priority.INTERACTIVE, Priority.PRODUCTION


def queued(job_id: str, sequence: int, priority: Priority = BATCH, region: str = "", **demand):
    return PendingJob(job_id, priority, sequence, demand or {"cpu": 1.0}, region)


def busy(job_id: str, cluster: str, sequence: int, priority=BATCH, stopping=False, **demand):
    return RunningJob(job_id, cluster, priority, sequence, demand, stopping)


def view(name: str, total: dict, free: dict | None = None, region: str = "") -> ClusterView:
    return ClusterView(name, total, dict(total) if free is None else free, region)


# -- never split, never summed ---------------------------------------------------------------


def test_an_8_gpu_gang_is_rejected_when_each_cluster_has_only_4():
    clusters = [view("a", {"cpu": 64, "h100": 4}), view("b", {"cpu": 64, "h100": 4})]
    decision = schedule([queued("big", 1, cpu=8, h100=8)], [], clusters)
    assert decision.assignments == [] and decision.preemptions == []
    assert "big" in decision.rejections
    assert "8 h100 on one cluster" in decision.rejections["big"]
    assert "never split" in decision.rejections["big"]
    # The same gang at half the size runs, whole, on one of them.
    decision = schedule([queued("half", 1, cpu=4, h100=4)], [], clusters)
    assert decision.assignments == [("half", "a")] and not decision.rejections


def test_free_capacity_is_never_summed_across_clusters():
    """Two clusters that could each hold the gang, each with half of it free: it waits."""
    clusters = [
        view("a", {"cpu": 64, "h100": 8}, {"cpu": 60, "h100": 4}),
        view("b", {"cpu": 64, "h100": 8}, {"cpu": 60, "h100": 4}),
    ]
    decision = schedule([queued("gang", 1, cpu=8, h100=8)], [], clusters)
    assert decision.assignments == [] and not decision.rejections
    assert decision.waiting["gang"].startswith("waiting for capacity: needs 8 h100")


def test_a_gang_whose_resources_exist_only_on_different_clusters_is_rejected():
    clusters = [view("gpu", {"cpu": 8, "h100": 16}), view("cpus", {"cpu": 256})]
    decision = schedule([queued("mixed", 1, cpu=100, h100=1)], [], clusters)
    assert decision.rejections == {
        "mixed": "no single cluster has every resource the gang needs at once"
    }


# -- constraints -------------------------------------------------------------------------------


def test_region_and_device_type_constraints():
    clusters = [
        view("us-small", {"cpu": 8, "h100": 8}, region="us"),
        view("eu-large", {"cpu": 256, "tpu-v5e": 32}, region="eu"),
    ]
    pending = [
        queued("eu-job", 1, region="eu", cpu=2),  # fits tighter on us-small, but must go to eu
        queued("ap-job", 2, region="ap", cpu=1),
        queued("eu-gpu", 3, region="eu", cpu=1, h100=1),  # h100 exists, but not in eu
        queued("unknown", 4, cpu=1, mi300=1),
        queued("us-gpu", 5, region="us", cpu=1, h100=1),
    ]
    decision = schedule(pending, [], clusters)
    assert sorted(decision.assignments) == [("eu-job", "eu-large"), ("us-gpu", "us-small")]
    assert decision.rejections == {
        "ap-job": "no cluster in region 'ap'",
        "eu-gpu": "no cluster has device type 'h100'",
        "unknown": "no cluster has device type 'mi300'",
    }


# -- order and placement -----------------------------------------------------------------------


def test_the_queue_is_served_by_priority_then_submission_order():
    clusters = [view("a", {"cpu": 4})]
    pending = [
        queued("batch-early", 1, BATCH, cpu=4),
        queued("interactive", 2, INTERACTIVE, cpu=4),
        queued("production-late", 3, PRODUCTION, cpu=4),
    ]
    decision = schedule(pending, [], clusters)
    assert decision.assignments == [("production-late", "a")]
    assert set(decision.waiting) == {"batch-early", "interactive"}
    # Within one band the earlier submission goes first, whatever the list order.
    pending = [queued("second", 7, INTERACTIVE, cpu=4), queued("first", 6, INTERACTIVE, cpu=4)]
    assert schedule(pending, [], clusters).assignments == [("first", "a")]


def test_a_job_goes_where_it_fits_most_tightly_and_each_assignment_uses_up_room():
    clusters = [
        view("roomy", {"cpu": 64, "h100": 16}, {"cpu": 64, "h100": 8}),
        view("snug", {"cpu": 64, "h100": 16}, {"cpu": 64, "h100": 3}),
        view("empty", {"cpu": 64, "h100": 16}),
    ]
    pending = [queued("one", 1, cpu=1, h100=2), queued("two", 2, cpu=1, h100=2)]
    decision = schedule(pending, [], clusters)
    # "one" leaves 1 h100 on snug, so "two" goes to the next tightest: roomy (8), not empty.
    assert decision.assignments == [("one", "snug"), ("two", "roomy")]
    # The home cluster is preferred whenever the job fits there.
    decision = schedule(pending, [], clusters, home="empty")
    assert decision.assignments == [("one", "empty"), ("two", "empty")]
    # ...and otherwise the tightest peer is chosen.
    decision = schedule([queued("big", 1, cpu=1, h100=6)], [], clusters, home="snug")
    assert decision.assignments == [("big", "roomy")]


# -- preemption --------------------------------------------------------------------------------


def test_production_preempts_on_the_cluster_needing_fewest_preemptions_and_holds_it():
    clusters = [
        view("a", {"cpu": 8}, {"cpu": 0}),
        view("b", {"cpu": 10}, {"cpu": 2}),
    ]
    running = [
        busy("a1", "a", 1, cpu=4),
        busy("a2", "a", 2, cpu=2),
        busy("a3", "a", 3, cpu=2),
        busy("b1", "b", 4, cpu=8),
    ]
    pending = [
        queued("prod", 10, PRODUCTION, cpu=4),
        queued("inter", 11, INTERACTIVE, cpu=2),  # would fit b's 2 free cpus, but b is held
        queued("batch", 12, BATCH, cpu=1),
    ]
    decision = schedule(pending, running, clusters)
    assert decision.preemptions == ["b1"]  # one job on b against two (a3, a2) on a
    assert decision.assignments == []
    assert decision.waiting["prod"] == "preempting batch work on b"
    assert decision.waiting["inter"].endswith("(held for production work)")
    assert "batch" in decision.waiting


def test_production_preempts_the_newest_batch_work_and_nothing_else():
    clusters = [view("a", {"cpu": 12}, {"cpu": 0})]
    running = [
        busy("old-big", "a", 1, cpu=6),
        busy("interactive", "a", 5, INTERACTIVE, cpu=2),
        busy("mid", "a", 2, cpu=2),
        busy("new", "a", 3, cpu=2),
    ]
    decision = schedule([queued("prod", 9, PRODUCTION, cpu=2)], running, clusters)
    assert decision.preemptions == ["new"]
    decision = schedule([queued("prod", 9, PRODUCTION, cpu=4)], running, clusters)
    assert decision.preemptions == ["new", "mid"]
    # Interactive and production work are never stopped: if batch work cannot make room,
    # nothing is preempted and the job waits.
    decision = schedule([queued("prod", 9, PRODUCTION, cpu=12)], running, clusters)
    assert decision.preemptions == [] and "prod" in decision.waiting


def test_interactive_and_batch_jobs_never_preempt():
    clusters = [view("a", {"cpu": 4}, {"cpu": 0})]
    running = [busy("r1", "a", 1, cpu=2), busy("r2", "a", 2, cpu=2)]
    pending = [queued("inter", 3, INTERACTIVE, cpu=2), queued("batch", 4, BATCH, cpu=2)]
    decision = schedule(pending, running, clusters)
    assert decision.preemptions == [] and decision.assignments == []
    assert set(decision.waiting) == {"inter", "batch"}


def test_capacity_already_stopping_is_counted_so_nothing_more_is_preempted():
    clusters = [view("a", {"cpu": 8}, {"cpu": 0})]
    running = [
        busy("stopping", "a", 1, stopping=True, cpu=4),
        busy("b2", "a", 2, cpu=2),
        busy("b3", "a", 3, cpu=2),
    ]
    # The stopping job's 4 cpus are coming back: enough for the production job, no new victim;
    # the cluster is still held so nothing lower takes the room meanwhile.
    pending = [queued("prod", 9, PRODUCTION, cpu=4), queued("batch", 10, cpu=1)]
    decision = schedule(pending, running, clusters)
    assert decision.preemptions == []
    assert decision.waiting["prod"] == "preempting batch work on a"
    assert decision.waiting["batch"].endswith("(held for production work)")
    # Needing 6: the 4 coming back and one more newest job, not two.
    decision = schedule([queued("prod", 9, PRODUCTION, cpu=6)], running, clusters)
    assert decision.preemptions == ["b3"]


def test_two_production_jobs_preempt_on_different_clusters_in_one_round():
    clusters = [view("a", {"cpu": 4}, {"cpu": 0}), view("b", {"cpu": 4}, {"cpu": 0})]
    running = [busy("a1", "a", 1, cpu=4), busy("b1", "b", 2, cpu=4)]
    pending = [queued("p1", 5, PRODUCTION, cpu=4), queued("p2", 6, PRODUCTION, cpu=4)]
    decision = schedule(pending, running, clusters)
    assert sorted(decision.preemptions) == ["a1", "b1"]
    assert {decision.waiting["p1"], decision.waiting["p2"]} == {
        "preempting batch work on a",
        "preempting batch work on b",
    }


# -- the reservation ledger ----------------------------------------------------------------------


def test_the_ledger_hands_out_nothing_before_a_report():
    ledger = CapacityLedger()
    assert ledger.free("a") == {}
    clusters = [ClusterView("a", {"cpu": 8}, ledger.free("a"))]
    assert schedule([queued("j", 1, cpu=1)], [], clusters).assignments == []


def test_the_ledger_never_over_assigns_across_several_ticks_between_reports():
    """One report, then ticks without one: assignments are subtracted until the next report,
    and a job that ends in between frees nothing until the engine says so."""
    ledger = CapacityLedger()
    ledger.report("a", {"cpu": 8, "h100": 4}, tick=1)
    ledger.report("b", {"cpu": 4}, tick=1)
    total = {"a": {"cpu": 8, "h100": 4}, "b": {"cpu": 4}}
    assigned: dict[str, dict[str, float]] = {"a": {}, "b": {}}
    pending = [queued(f"j{n}", n, cpu=1, h100=1) for n in range(10)]
    for tick in range(1, 6):
        clusters = [ClusterView(name, total[name], ledger.free(name)) for name in total]
        decision = schedule(pending, [], clusters)
        for job_id, cluster in decision.assignments:
            job = next(p for p in pending if p.job_id == job_id)
            ledger.reserve(job_id, cluster, job.demand, tick)
            for kind, amount in job.demand.items():
                assigned[cluster][kind] = assigned[cluster].get(kind, 0.0) + amount
            pending.remove(job)
        assert assigned["a"].get("h100", 0.0) <= 4 and not assigned["b"]
    assert len(pending) == 6
    assert ledger.free("a") == {"cpu": 4.0, "h100": 0.0}
    # The engine's next report includes those launches (2 of them already ended): the
    # reservations of earlier ticks go, the report's numbers stand.
    ledger.report("a", {"cpu": 6, "h100": 2}, tick=6)
    assert ledger.free("a") == {"cpu": 6, "h100": 2}


def test_a_report_clears_only_its_own_clusters_reservations_from_earlier_ticks():
    ledger = CapacityLedger()
    ledger.report("a", {"cpu": 8}, tick=1)
    ledger.report("b", {"cpu": 8}, tick=1)
    ledger.reserve("x", "a", {"cpu": 3}, tick=1)
    ledger.reserve("y", "b", {"cpu": 2}, tick=1)
    ledger.report("b", {"cpu": 6}, tick=2)  # includes y; says nothing about a
    assert ledger.free("a") == {"cpu": 5} and ledger.free("b") == {"cpu": 6}
    ledger.reserve("z", "a", {"cpu": 1}, tick=2)
    ledger.report("a", {"cpu": 5}, tick=2)  # taken before tick 2's launch of z: z stays
    assert ledger.free("a") == {"cpu": 4}
