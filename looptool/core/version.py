"""looptool's version string, in one place every layer may import."""

__version__ = "0.1.0"
