"""Test and development helpers that need no mocks: a real S3 server (SeaweedFS)."""

from raylm.testing.seaweedfs import SeaweedFS, SeaweedFSError, find_weed, free_ports

__all__ = ["SeaweedFS", "SeaweedFSError", "find_weed", "free_ports"]
