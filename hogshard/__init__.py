"""hogshard.hogshard."""
