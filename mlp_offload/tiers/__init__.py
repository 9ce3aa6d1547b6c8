"""Storage tiers for optimizer state: host memory and any number of file paths."""
