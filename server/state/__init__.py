"""State shared by replicas (`state.url`): tenant quotas in Redis."""
