"""The base every stage builds on: the annotated layer graph, loop plans with their cost model,
error types and the version. Imports nothing else from looptool."""
