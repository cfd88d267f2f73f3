from plexrl.service import configure_logging, run_until_signalled
from plexrl.settings import WorkerSettings
from plexrl_worker.main import serve


def main() -> None:
    settings = WorkerSettings()
    configure_logging(settings.log_level)
    if settings.worker_rank > 0:
        # A rank on another host than its leader's: it joins the leader's group and runs
        # what the leader broadcasts; it speaks to neither Kafka nor Redis.
        from plexrl_worker.rank_main import follow_leader

        follow_leader(settings)
        return
    run_until_signalled(lambda stop: serve(settings, stop), settings.event_loop)


if __name__ == "__main__":
    main()
