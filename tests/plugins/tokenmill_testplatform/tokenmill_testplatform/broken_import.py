"""A platform module that fails to import (a missing vendor SDK, say): reported, skipped."""
import tokenmill_testplatform_vendor_sdk  # noqa: F401  (does not exist, on purpose)


class BrokenPlatform:  # pragma: no cover - never reached
    pass
