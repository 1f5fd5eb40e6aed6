"""hogshard.ps."""
