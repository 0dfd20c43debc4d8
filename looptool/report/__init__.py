"""Reporting: rich tables, their JSON twins, and every plot."""
