"""What a shared deployment charges: each job's used device-seconds (its calls, its
stragglers' share of the group, its swaps), the time each group was held, the
cluster's hourly timeline, and at the end each job's occupied cost (its share, by use,
of every second its group was held)."""

from __future__ import annotations

from plexrl_sim.results import DeploymentResult, GroupUsage, JobResult, Timeline


class Accounting:
    def __init__(self, usage: dict[str, GroupUsage]) -> None:
        self.usage = usage
        self.timeline = Timeline()
        self._held_since: dict[str, float] = {}
        self._used: dict[str, dict[str, float]] = {}
        """Per group, the device-seconds each job used there (its home, or a group its
        samples roamed to)."""

    def charge(self, job: JobResult, group_id: str, device_s: float) -> None:
        """Bill `device_s` of the group's time to the job."""
        job.used_device_s += device_s
        self.usage[group_id].used_device_s += device_s
        used = self._used.get(group_id)
        if used is None:
            used = self._used[group_id] = {}
        used[job.job_id] = used.get(job.job_id, 0.0) + device_s

    def busy(self, start: float, end: float, useful_device_s: float) -> None:
        """Useful work done over [start, end) (the cluster's busy timeline)."""
        self.timeline.add("busy", start, end, useful_device_s)

    def hold(self, group_id: str, now: float, jobs: int) -> None:
        """A job was homed on the group (`jobs` are homed there now)."""
        usage = self.usage[group_id]
        usage.peak_jobs = max(usage.peak_jobs, jobs)
        self._held_since.setdefault(group_id, now)

    def release(self, group_id: str, now: float) -> None:
        """The group's last job left: it stops costing the cluster."""
        since = self._held_since.pop(group_id, None)
        if since is None:
            return
        usage = self.usage[group_id]
        usage.held_s += now - since
        self.timeline.add("allocated", since, now, (now - since) * usage.devices)

    def close(
        self,
        name: str,
        gpus: int,
        jobs: list[JobResult],
        now: float,
        wall_s: float,
        events: int,
        plans: int,
        plan_s: float,
        counts: dict[str, int] | None = None,
    ) -> DeploymentResult:
        """Release every group still held at `now` and share each group's held time among
        the jobs that used it, in proportion to their use there."""
        for group_id in list(self._held_since):
            self.release(group_id, now)
        by_id = {job.job_id: job for job in jobs}
        for job in jobs:
            job.occupied_gpu_s = 0.0
        for group_id, used in self._used.items():
            usage = self.usage[group_id]
            held = usage.held_s * usage.devices
            total = sum(used.values())
            if total <= 0:
                continue
            for job_id, device_s in used.items():
                by_id[job_id].occupied_gpu_s += held * device_s / total
        return DeploymentResult(
            name=name,
            kind="multiplexed",
            gpus=gpus,
            jobs=jobs,
            timeline=self.timeline,
            groups=list(self.usage.values()),
            wall_s=wall_s,
            events=events,
            plans=plans,
            plan_s=plan_s,
            counts=counts or {},
        )
