"""Cluster definitions (launcher and KubeRay YAML) and the development tooling that stands in
for a cluster on one machine: a local multi-node Ray, a local S3 server, chaos helpers.
Imported by tests, benchmarks and scripts from a checkout; never part of the raylm wheel."""
