"""hogshard.proto."""
