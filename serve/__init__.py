"""HTTP server for ds4_torch models (comes in a later issue)."""
