"""hogshard.scheduler."""
