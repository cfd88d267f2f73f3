from plexrl.service import configure_logging, run_until_signalled
from plexrl.settings import SchedulerSettings
from plexrl_scheduler.main import serve


def main() -> None:
    settings = SchedulerSettings()
    configure_logging(settings.log_level)
    run_until_signalled(lambda stop: serve(settings, stop), settings.event_loop)


if __name__ == "__main__":
    main()
