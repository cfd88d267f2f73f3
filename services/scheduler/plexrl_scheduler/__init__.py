"""The scheduler service: the cluster view and every placement, dispatch and swap decision."""
