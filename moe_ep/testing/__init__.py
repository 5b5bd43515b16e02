"""Test support shared by tests/ and ``moe-ep fuzz``: strategies, property checks, stand-ins."""
