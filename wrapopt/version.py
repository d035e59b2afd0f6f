"""The package version, in one place (plan files and exports record it)."""

__version__ = "0.1.0"
