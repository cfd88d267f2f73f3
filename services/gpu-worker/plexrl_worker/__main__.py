from plexrl.service import configure_logging, run_until_signalled
from plexrl.settings import WorkerSettings
from plexrl_worker.main import serve


def main() -> None:
    settings = WorkerSettings()
    configure_logging(settings.log_level)
    run_until_signalled(lambda stop: serve(settings, stop))


if __name__ == "__main__":
    main()
