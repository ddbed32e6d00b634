"""A platform built for a platform API version this tokenmill does not speak: reported, skipped."""
from tokenmill.platforms.interface import Availability, Platform


class WrongApiVersionPlatform(Platform):
    """Built against a future platform API."""
    api_version = 999
    name = "testcpu_oldapi"

    @classmethod
    def probe(cls):
        return Availability.yes("would run, but speaks the wrong API version")
