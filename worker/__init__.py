"""hogshard.worker."""
