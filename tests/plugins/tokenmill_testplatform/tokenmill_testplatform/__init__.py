"""tokenmill-testplatform: a third-party tokenmill plugin used by the test suite."""
__version__ = "0.1.0"
