"""The package version (its own module, so that modules below the package can name it)."""

__version__ = "0.2.0"
