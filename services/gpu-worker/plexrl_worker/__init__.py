"""The gpu-worker service: one device group, its engine, the job states resident on it."""
